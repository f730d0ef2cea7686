"""`dflash generate`'s content key names only the sampling settings that decide the rows.

A text window writes text.new_tokens (sampling.max_new_tokens is never read for it) and a greedy
run takes the target's argmax (no seed or top-p changes it): a resume that changed them was
refused although the rows would be the same. Folders begun before named them in their key and
still resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.generated import manifest_path, read_manifest
from stage1_extract.store_root import content_key
from stage1_generate import run as generate_run
from stage1_generate.run import run_generate
from tests.test_generate import TEXTS, chat_rows, config, digests, write_jsonl


def _killed_after_first_chunk(cfg, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Run `cfg` until its second chunk is about to be committed (as a kill then)."""
    real = generate_run.write_chunk
    calls = []

    def dies_on_second_chunk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_run, "write_chunk", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        run_generate(cfg)
    monkeypatch.setattr(generate_run, "write_chunk", real)


@pytest.mark.parametrize(
    "shape,changed",
    [
        ("text", ("sampling.max_new_tokens=9",)),  # text windows write text.new_tokens
        ("text", ("sampling.seed=5", "sampling.top_p=0.5", "sampling.top_k=3")),  # greedy
        ("chat", ("sampling.seed=5", "sampling.top_p=0.5", "sampling.top_k=3")),  # greedy
    ],
)
def test_a_resume_that_changes_only_unused_sampling_settings_goes_on(
    tiny_qwen3: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shape: str,
    changed: tuple[str, ...],
) -> None:
    rows = [{"text": t} for t in TEXTS] if shape == "text" else chat_rows()
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    whole = tmp_path / "whole"
    run_generate(config(tiny_qwen3, data, whole))
    out = tmp_path / "out"
    _killed_after_first_chunk(config(tiny_qwen3, data, out), monkeypatch)
    assert run_generate(config(tiny_qwen3, data, out, *changed))["complete"]
    assert digests(out) == digests(whole)  # the rows of one run


@pytest.mark.parametrize(
    "shape,changed,named",
    [
        ("chat", ("sampling.max_new_tokens=7",), r"max_new_tokens: 6 -> 7"),
        ("text", ("sampling.temperature=0.5",), r"temperature: 0\.0 -> 0\.5"),
        ("sampled", ("sampling.seed=5",), r"seed: 0 -> 5"),
        ("sampled", ("sampling.top_p=0.5",), r"top_p: 1\.0 -> 0\.5"),
        ("sampled", ("sampling.top_k=3",), r"top_k: .* -> 3"),
    ],
)
def test_a_resume_that_changes_what_decides_the_rows_is_refused(
    tiny_qwen3: Path, tmp_path: Path, shape: str, changed: tuple[str, ...], named: str
) -> None:
    rows = [{"text": t} for t in TEXTS] if shape == "text" else chat_rows()
    data = write_jsonl(tmp_path / "rows.jsonl", rows[:2])
    sampled = ("sampling.temperature=0.7",) if shape == "sampled" else ()
    out = tmp_path / "out"
    run_generate(config(tiny_qwen3, data, out, *sampled))
    with pytest.raises(ValueError, match=rf"other settings \(.*sampling\.{named}[;)]"):
        run_generate(config(tiny_qwen3, data, out, *sampled, *changed))


def _as_begun_before(out: Path, sampling: dict) -> None:
    """Rewrite `out`'s manifest as versions before wrote it: every sampling setting in its
    content and key, the folder unfinished."""
    manifest = read_manifest(out)
    manifest["content"]["sampling"] = sampling
    manifest.update(key=content_key(manifest["content"]), complete=False)
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    (out / ".dflash-generate" / "chunk-000001.json").unlink()


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_a_folder_begun_before_resumes_with_its_settings(
    tiny_qwen3: Path, tmp_path: Path, shape: str
) -> None:
    """Its key named every sampling setting: the same settings resume it (greedy: another seed
    too, which changes nothing), other decisive ones are still refused."""
    rows = [{"text": t} for t in TEXTS] if shape == "text" else chat_rows()
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    run_generate(config(tiny_qwen3, data, out))
    before = digests(out)
    everything = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 6, "seed": 0}
    _as_begun_before(out, everything)
    old_key = read_manifest(out)["key"]
    assert run_generate(config(tiny_qwen3, data, out))["complete"]
    assert digests(out) == before
    assert read_manifest(out)["key"] == old_key  # the manifest of the run that began it
    _as_begun_before(out, everything)
    assert run_generate(config(tiny_qwen3, data, out, "sampling.seed=3"))["complete"]
    assert digests(out) == before
    _as_begun_before(out, everything)
    with pytest.raises(ValueError, match=r"other settings \(.*sampling\.temperature: 0\.0 -> 0\.5"):
        run_generate(config(tiny_qwen3, data, out, "sampling.temperature=0.5"))


def test_a_sampled_folder_begun_before_top_k_resumes(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A sampled folder begun before sampling.top_k existed named no top_k (it sampled from
    every token): top_k 0, the default, resumes it; another top_k is refused."""
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows())
    out, sampled = tmp_path / "out", "sampling.temperature=0.7"
    run_generate(config(tiny_qwen3, data, out, sampled))
    before = digests(out)
    old = {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 6, "seed": 0}
    _as_begun_before(out, old)
    assert run_generate(config(tiny_qwen3, data, out, sampled))["complete"]
    assert digests(out) == before
    _as_begun_before(out, old)
    with pytest.raises(ValueError, match=r"other settings \(.*sampling\.top_k"):
        run_generate(config(tiny_qwen3, data, out, sampled, "sampling.top_k=3"))
