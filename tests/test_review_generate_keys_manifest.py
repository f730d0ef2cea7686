"""`dflash generate`'s manifest names the run that wrote the folder's rows.

A first run that wrote no chunk (a wrong --endpoint port) left its endpoint and start in the
manifest for good, whatever run wrote the rows; the run that writes the first chunk now
replaces them, and each chunk's record names the endpoint that wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.generated import manifest_path, read_manifest
from stage1_generate.run import run_generate
from tests.openai_server import OpenAIServer
from tests.test_generate import chat_rows, config, write_jsonl
from tests.test_review_generate_keys import _killed_after_first_chunk


def test_the_manifest_names_the_run_that_wrote_the_first_chunk(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first run at a wrong port fails before any chunk: the resume through the right one is
    the folder's first writer, so the manifest names its endpoint and start. A later resume
    through another server keeps them, and each chunk's record names its own endpoint."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    out = tmp_path / "out"
    remote = ["run.backend=openai", "endpoint.max_retries=0", "endpoint.concurrency=2"]
    wrong = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    with pytest.raises(ValueError, match="unreachable"):
        run_generate(config(tiny_qwen3, data, out, *remote, f"endpoint.url={wrong}"))
    first = read_manifest(out)
    assert first is not None and not list(out.glob("part-*"))  # nothing but the manifest
    first["created"] = "2000-01-01T00:00:00+00:00"  # as a run long ago
    manifest_path(out).write_text(json.dumps(first, indent=2))
    with OpenAIServer(tiny_qwen3) as server:
        _killed_after_first_chunk(
            config(tiny_qwen3, data, out, *remote, f"endpoint.url={server.url}"), monkeypatch
        )
        began = read_manifest(out)
        assert began["backend"] == {"kind": "openai", "endpoint": server.url}
        assert began["created"] != first["created"]
    with OpenAIServer(tiny_qwen3) as other:
        final = run_generate(config(tiny_qwen3, data, out, *remote, f"endpoint.url={other.url}"))
    assert final["complete"]
    assert (final["backend"], final["created"]) == (began["backend"], began["created"])
    records = [json.loads(p.read_text()) for p in sorted(out.glob(".dflash-generate/chunk-*"))]
    assert [r["endpoint"] for r in records] == [server.url, other.url, other.url]
    assert "endpoint" not in final["counts"]  # summed counts only
