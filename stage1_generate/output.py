"""The output folder of `dflash generate`: chunk files, their bookkeeping, and resume.

    OUT/part-000000.jsonl.gz ...      the rows (what `dflash extract --data OUT` reads)
    OUT/.dflash-generate/manifest.json  provenance: settings, target fingerprint, counts
    OUT/.dflash-generate/chunk-000000.json  one chunk's counts, written after its rows
    OUT/.dflash-generate.lock           held by the run writing the folder (common/locks.py)

Chunk c holds the output rows of source rows [c * R, (c + 1) * R). Its data file is written to
a temporary name, synced and renamed, then its counts file likewise: a chunk is done exactly
when its counts file exists, so a killed run redoes at most the chunks in flight, and never
keeps half a file (a chunk whose rows were all skipped has a counts file and no data file).
The folder's hidden entries are skipped by extract's data loader.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.durable import fsync_path
from common.generated import META_DIR, manifest_path, read_manifest
from common.locks import exclusive_lock
from common.logging import get_logger
from stage1_extract.store_root import content_key
from stage1_generate.inputs import REPLY_SPECIALS, REPLY_STOP, TURN_ENDS, decisive_content

LOCK_FILE = ".dflash-generate.lock"  # hidden: extract's data loader skips it


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


# what the rows of a version before each content marker left out
OLDER_ROWS = {
    REPLY_SPECIALS: "the special tokens a target writes inside a reply (e.g. <|python_tag|>, a "
    "tool-call marker)",
    REPLY_STOP: "the stop token that ended a text or completion reply (e.g. <|endoftext|>)",
    TURN_ENDS: "the record of which chat replies the target did not end (cut at the token "
    "limit), without which extract trains on the end of turn after them",
}


def _older_version_of(old: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What the rows of `old` left out, when it has the settings of `manifest` but was written
    by a version before some of its markers (`OLDER_ROWS`); empty when it is no such folder."""
    content = manifest["content"]
    missing = [k for k in OLDER_ROWS if k in content and k not in old["content"]]
    if not missing:
        return []
    earlier = {k: v for k, v in content.items() if k not in missing}
    return [OLDER_ROWS[k] for k in missing] if old["key"] == content_key(earlier) else []


def _as_decided_now(old: dict[str, Any]) -> dict[str, Any]:
    """`old` with the content and key this version gives its settings: a folder begun before
    `decisive_sampling` named sampling settings its rows do not depend on (text rows'
    max_new_tokens, a greedy run's seed and top-p); its stored key stands where none is left
    out."""
    content = decisive_content(old["content"])
    if content == old["content"]:
        return old
    return {**old, "content": content, "key": content_key(content)}


def _others(out: Path) -> list[Path]:
    """What the folder holds besides its lock file."""
    return [p for p in out.iterdir() if p.name != LOCK_FILE] if out.is_dir() else []


def check_output_folder(out: Path, overwrite: bool, data: str | None = None) -> None:
    """Refuse a file, or a folder of other things (never lock or delete what is not ours), or
    one inside the local data folder `data` (read with its sub-folders: a rerun would read the
    rows written there as source rows, and fail on their columns)."""
    source = Path(data).expanduser() if data else None
    if source is not None and source.is_dir() and out.resolve().is_relative_to(source.resolve()):
        raise ValueError(
            f"--out {out} is inside --data {data}, whose files are read with its sub-folders: "
            "a rerun or resume would read the rows written there as source rows; pick an --out "
            "outside it"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder path")
    if _others(out) and read_manifest(out) is None:
        raise ValueError(
            f"--out {out} exists and is not a `dflash generate` folder; pass an empty or new "
            "folder" + ("" if overwrite else " (or --overwrite to replace a generate folder)")
        )


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """One `dflash generate` per output folder: a second is refused naming the first."""
    out.mkdir(parents=True, exist_ok=True)

    def refused(holder: str) -> ValueError:
        return ValueError(
            f"--out {out} is being written by another `dflash generate` ({holder}); wait for "
            "it to end (or stop it), then rerun this command to resume"
        )

    with exclusive_lock(out / LOCK_FILE, refused):
        yield


def prepare_output(out: Path, manifest: dict[str, Any], overwrite: bool) -> None:
    """Create the folder with `manifest`, or check that an existing one was made by the same
    settings (then the run resumes it, under its manifest); `manifest` replaces one under which
    no chunk is committed, whatever its settings. The caller holds `output_lock(out)`."""
    check_output_folder(out, overwrite)
    if overwrite:
        for path in _others(out):  # the held lock file stays
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    # temporary files of a killed run (the lock says no writer is alive): never committed
    for leftover in [*out.glob(".tmp-*"), *(out / META_DIR).glob(".tmp-*")]:
        leftover.unlink()
    old = read_manifest(out) if out.exists() else None
    if old is not None and not done_chunks(out):
        # the runs before committed no chunk (one given a wrong --endpoint port, one that failed
        # in its first chunk): nothing of theirs stays, whatever their settings, so this run's
        # manifest (its settings, endpoint and start) replaces theirs, and their rows of a
        # chunk written but never committed go
        if _as_decided_now(old)["key"] != manifest["key"]:
            changed = _differences(_as_decided_now(old)["content"], manifest["content"])
            get_logger().info(
                f"--out {out}: the runs before committed no chunk; starting afresh with these "
                f"settings ({'; '.join(changed)})"
            )
        for part in out.glob("part-*.jsonl.gz"):
            part.unlink()
        old = None
    if old is not None:
        old = _as_decided_now(old)
        left_out = _older_version_of(old, manifest) if old["key"] != manifest["key"] else []
        if left_out:
            if old.get("complete"):
                return  # nothing left to generate, so nothing to mix: kept as it is
            raise ValueError(
                f"--out {out} was begun by an older dflash-offline, which left "
                f"{' and '.join(left_out)} out of its rows; this version writes them, and the "
                "chunks of both would mix: generate into a new --out, or pass --overwrite to "
                "regenerate this one"
            )
        if old["key"] != manifest["key"]:
            changed = _differences(old["content"], manifest["content"])
            raise ValueError(
                f"--out {out} was generated with other settings ({'; '.join(changed)}); rerun "
                "with the same settings to resume, pick another --out, or --overwrite"
            )
        _check_stop_ids(out, old, manifest)
        return  # the manifest names the run that wrote the first chunk
    (out / META_DIR).mkdir(parents=True, exist_ok=True)
    _write_atomic(manifest_path(out), json.dumps(manifest, indent=2).encode())


def _check_stop_ids(out: Path, old: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Refuse a resume whose replies would end at other stop ids than the folder's (its
    generation_config.json's end of sequence or its tokenizer changed since: the key names
    neither's contents). Folders begun before `stop_ids` was recorded resume as before, and
    text windows written past the end of text (stop_at_eos false) stop at none."""
    before, now = old.get("stop_ids"), manifest.get("stop_ids")
    content = manifest["content"]
    past_eos = content["format"] == "text" and content["text"].get("stop_at_eos") is False
    if before is None or now is None or before == now or past_eos:
        return
    raise ValueError(
        f"--out {out} was generated with replies ending at stop ids {before}, and this target "
        f"ends them at {now} (the tokenizer's and generation_config.json's end of sequence, "
        "the chat template's end of turn: one of them changed since); the chunks of both "
        "would mix: rerun with the target's files as they were, pick another --out, or "
        "--overwrite"
    )


def chunk_file(out: Path, chunk: int) -> Path:
    return out / f"part-{chunk:06d}.jsonl.gz"


def _stats_file(out: Path, chunk: int) -> Path:
    return out / META_DIR / f"chunk-{chunk:06d}.json"


def done_chunks(out: Path) -> set[int]:
    return {int(p.stem.split("-")[1]) for p in (out / META_DIR).glob("chunk-*.json")}


def write_chunk(out: Path, chunk: int, rows: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    """Commit one chunk: its rows (if any), then its counts (which mark it done)."""
    if rows:
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        # mtime=0: the same rows give the same bytes, so a resumed folder equals a fresh one
        _write_atomic(chunk_file(out, chunk), gzip.compress(lines.encode(), mtime=0))
    else:
        chunk_file(out, chunk).unlink(missing_ok=True)
    _write_atomic(_stats_file(out, chunk), json.dumps(stats, sort_keys=True).encode())


def chunk_stats(out: Path) -> list[dict[str, Any]]:
    return [json.loads(_stats_file(out, c).read_text()) for c in sorted(done_chunks(out))]


def finalize_output(out: Path, counts: dict[str, Any]) -> dict[str, Any]:
    """Record the totals and `complete: true` in the manifest; return it."""
    manifest = read_manifest(out)
    assert manifest is not None
    manifest.update(counts=counts, complete=True)
    _write_atomic(manifest_path(out), json.dumps(manifest, indent=2).encode())
    return manifest
