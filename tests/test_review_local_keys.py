"""target.revision and data.name count in the resume keys only where they are read: a hub id's
revision and a hub dataset's config name. A local target folder and a local data file ignore
them, so a resume that changed them (which writes the same store or rows) goes on; stores and
folders begun before, whose key named them, resume too (extract: `earlier_key` with the
store's own values; generate: `decisive_content` of the old manifest)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_extract import make_config, write_data
from test_extract_resume import LAYERS, _extract_killed_after_two_commits, assert_same_store

from common.generated import manifest_path, read_manifest
from common.store import StoreError, committed_shards
from stage1_extract.job import plan_job
from stage1_extract.run import run_extract
from stage1_extract.store_root import content_key, key_parts, prepare_store
from stage1_generate.run import run_generate
from tests.test_generate import TEXTS, config, digests, write_jsonl
from tests.test_review_generate_keys import _killed_after_first_chunk

UNREAD = ("target.revision=v2", "data.name=other")


def test_a_killed_local_extract_resumes_under_another_revision_and_name(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    data = write_data(tmp_path)
    whole = tmp_path / "whole"
    run_extract(make_config(tiny_qwen3, data, whole, LAYERS))
    out = tmp_path / "out"
    _extract_killed_after_two_commits(tiny_qwen3, data, out, "target.revision=v1")
    assert committed_shards(out) == [0, 1]
    run_extract(make_config(tiny_qwen3, data, out, LAYERS, *UNREAD))
    assert_same_store(out, whole)


def _as_begun_before(store: Path, job_attrs: dict, revision: str, name: str) -> dict:
    """Root attributes of a store begun before the change with `revision` and `name` set: its
    key hashed them as given."""
    old = copy.deepcopy(job_attrs)
    old["target"]["revision"] = revision
    old["extract_config"]["data"]["name"] = name
    old["dataset"]["name"] = name
    parts = key_parts(old, "lengths", {})
    parts["target"]["revision"], parts["data"]["name"] = revision, name  # as it hashed them
    old["content_key"] = content_key(parts)
    prepare_store(store, old, overwrite=False)
    return old


def test_a_local_store_keyed_before_resumes_under_any_revision(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    data = write_data(tmp_path, num_rows=2)
    store = tmp_path / "store"
    job = plan_job(make_config(tiny_qwen3, data, store, LAYERS, *UNREAD))
    new = copy.deepcopy(job.attrs)
    parts = key_parts(new, "lengths", {})
    new["content_key"] = content_key(parts)
    _as_begun_before(store, job.attrs, "v1", "first")
    assert prepare_store(store, new, overwrite=False, parts=parts) == []
    # without the rule the old key is another store's
    with pytest.raises(StoreError, match="other settings or data"):
        prepare_store(store, new, overwrite=False)
    # the rule takes back only what a local path ignores
    new["topk"] = parts["topk"] = 1
    new["content_key"] = content_key(parts)
    with pytest.raises(StoreError, match=r"\(verifier\.topk \(8 -> 1\) differ\)"):
        prepare_store(store, new, overwrite=False, parts=parts)


def test_a_hub_targets_revision_and_a_hub_datasets_name_still_count(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    data = write_data(tmp_path, num_rows=2)
    job = plan_job(make_config(tiny_qwen3, data, tmp_path / "unused", LAYERS))

    def hub(field: str, value: str, store: Path) -> tuple[dict, dict]:
        attrs = copy.deepcopy(job.attrs)
        if field == "revision":
            attrs["target"] |= {"name_or_path": "org/model", "revision": value}
        else:
            attrs["extract_config"]["data"] |= {"path": "org/rows", "name": value}
            attrs["dataset"] |= {"path": "org/rows", "name": value}
        parts = key_parts(attrs, "lengths", {})
        attrs["content_key"] = content_key(parts)
        return attrs, parts

    for field, named in (("revision", "target"), ("name", "dataset")):
        store = tmp_path / field
        first, parts = hub(field, "a", store)
        prepare_store(store, first, overwrite=False, parts=parts)
        assert prepare_store(store, first, overwrite=False, parts=parts) == []
        other, parts = hub(field, "b", store)
        with pytest.raises(StoreError, match=rf"\({named}(, data\.name .*)? differ\)"):
            prepare_store(store, other, overwrite=False, parts=parts)


def test_a_killed_local_generate_resumes_under_another_revision_and_name(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in TEXTS])
    whole = tmp_path / "whole"
    run_generate(config(tiny_qwen3, data, whole))
    out = tmp_path / "out"
    _killed_after_first_chunk(config(tiny_qwen3, data, out, "target.revision=v1"), monkeypatch)
    assert run_generate(config(tiny_qwen3, data, out, *UNREAD))["complete"]
    assert digests(out) == digests(whole)


def test_a_generate_folder_begun_before_with_a_revision_resumes(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "out"
    run_generate(config(tiny_qwen3, data, out))
    before = digests(out)
    manifest = read_manifest(out)
    assert manifest["content"]["target"]["revision"] is None
    # as versions before wrote it under target.revision=v1 data.name=first, unfinished
    manifest["content"]["target"]["revision"] = "v1"
    manifest["content"]["data"]["name"] = "first"
    manifest.update(key=content_key(manifest["content"]), complete=False)
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    (out / ".dflash-generate" / "chunk-000001.json").unlink()
    assert run_generate(config(tiny_qwen3, data, out, *UNREAD))["complete"]
    assert digests(out) == before
