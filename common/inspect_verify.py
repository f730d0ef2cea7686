"""`dflash inspect verify STORE`: check every committed shard against FORMAT.md.

Store-level checks (root attributes, target head, planned vs committed shards, root counts
against what the shards hold) here; each shard is streamed through common/inspect_shard.py,
so a store of any size is checked in constant memory. Every problem names the shard, the
array and what is wrong; `run_verify` prints them and returns False, or prints "OK".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors import safe_open
from tqdm import tqdm

from common.inspect_shard import CHUNK_BYTES, Problem, check_shard
from common.store import (
    HEAD_FILE,
    StoreInfo,
    committed_shards,
    open_store,
    shard_name,
)


def _check_head(info: StoreInfo) -> list[Problem]:
    """target_head.safetensors holds bf16 embedding, final norm and LM head of the right shapes."""
    path = info.path / HEAD_FILE
    if not path.is_file():
        return [Problem("store", HEAD_FILE, "file missing")]
    d, v = info.hidden_size, info.vocab_size
    expected = {"embed_tokens.weight": (None, d), "norm.weight": (d,), "lm_head.weight": (v, d)}
    problems = []
    try:
        with safe_open(str(path), "pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 (not iterable)
            found = {k: (tuple(t.get_shape()), t.get_dtype()) for k, t in slices.items()}
    except Exception as err:  # safetensors raises its own error types for a damaged header
        return [Problem("store", HEAD_FILE, f"unreadable ({type(err).__name__}: {err})")]
    for key, shape in expected.items():
        if key not in found:
            problems.append(Problem("store", HEAD_FILE, f"tensor {key} missing"))
            continue
        got, dtype = found[key]
        if len(got) != len(shape) or any(
            e is not None and e != g for e, g in zip(shape, got, strict=True)
        ):
            problems.append(Problem("store", HEAD_FILE, f"{key} has shape {got}, expected {shape}"))
        if dtype != "BF16":
            problems.append(Problem("store", HEAD_FILE, f"{key} is {dtype}, expected BF16"))
    return problems


def verify_store(store: str | Path, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Check a whole store; returns a JSON-ready report whose "problems" is empty when all is well."""
    info = open_store(store)  # format, version and root attributes, with their messages
    problems = _check_head(info)
    committed = committed_shards(info.path)
    planned = set(range(info.num_shards))
    for index in sorted(set(committed) - planned):
        problems.append(
            Problem(shard_name(index), "-", f"not in the plan of {info.num_shards} shards")
        )
    missing_shards = sorted(planned - set(committed))
    if info.complete:
        for index in missing_shards:
            problems.append(
                Problem(shard_name(index), "-", "missing, yet the store is marked complete")
            )
    totals = dict.fromkeys(["sequences", "documents", "tokens", "loss_tokens"], 0)
    all_counted = not missing_shards
    with tqdm(total=len(committed), desc="verify", unit="shard", disable=None) as bar:
        for index in committed:
            shard_problems, counts = check_shard(info, index, bar, chunk_bytes)
            problems += shard_problems
            all_counted &= counts is not None
            for key in totals:
                totals[key] += counts[key] if counts else 0
    # Root counts are compared only when every planned shard was measured: otherwise a missing
    # or broken shard, already reported, would show up a second time as a count mismatch.
    if info.complete and all_counted:
        totals["padding_tokens"] = totals["sequences"] * info.seq_len - totals["tokens"]
        recorded = info.attrs.get("counts") or {}
        for key, value in totals.items():
            if recorded.get(key) != value:
                what = f"{key} is {recorded.get(key)} but the shards hold {value}"
                problems.append(Problem("store", "counts", what))
    return {
        "store": str(store),
        "ok": not problems,
        "complete": info.complete,
        "planned_shards": info.num_shards,
        "committed_shards": len(committed),
        "in_progress": not info.complete,
        "checked": totals,
        "problems": [asdict(p) for p in problems],
    }


def run_verify(store: str | Path, as_json: bool = False) -> bool:
    """Verify `store`, print the report (text or one JSON object) and return whether it is OK."""
    report = verify_store(store)
    if as_json:
        print(json.dumps(report))
        return report["ok"]
    if report.get("in_progress"):
        print(
            f"extraction in progress: {report['committed_shards']}/{report['planned_shards']} "
            "shards committed; only those were checked"
        )
    if report["ok"]:
        checked = report["checked"]
        print(
            f"OK: {report['committed_shards']} shards, {checked['sequences']:,} sequences, "
            f"{checked['tokens']:,} tokens verified"
        )
        return True
    count = len(report["problems"])
    print(f"FAILED: {count} problem{'s' if count != 1 else ''}")
    width = max(len(p["array"]) for p in report["problems"])
    for p in report["problems"]:
        print(f"  {p['shard']:<13} {p['array']:<{width}}  {p['problem']}")
    return False
