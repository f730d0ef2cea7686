"""Compare two `dflash generate` outputs of the same rows, e.g. target.attn_implementation=sdpa
vs sdpa_gqa_decode on real pystd windows: how many rows are identical, how far identical rows'
text runs when they differ, and each run's throughput from its log line.

    python bench/generate_attn_check.py GEN_A LOG_A GEN_B LOG_B   # prints one JSON line

Greedy decoding in fp32 is not bitwise the same across attention kernels: a near-tie of the
target's top two logits can flip, and the row continues differently from there. Both outputs
are then the target's own greedy text under its arithmetic; the figure says how often.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path


def read_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("part-*.jsonl.gz")):
        rows += [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
    return rows


def tokens_per_s(log: Path) -> float | None:
    """The 'N new tokens/s' figure of generate's last summary line."""
    found = re.findall(r"\(([\d.]+) new tokens/s\)", log.read_text(errors="replace"))
    return float(found[-1]) if found else None


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def main() -> None:
    gen_a, log_a, gen_b, log_b = (Path(p) for p in sys.argv[1:5])
    rows_a, rows_b = read_rows(gen_a), read_rows(gen_b)
    if len(rows_a) != len(rows_b):
        raise SystemExit(
            f"{gen_a} has {len(rows_a)} rows, {gen_b} {len(rows_b)}: not the same input"
        )
    texts = [
        (json.dumps(a, sort_keys=True), json.dumps(b, sort_keys=True))
        for a, b in zip(rows_a, rows_b, strict=True)
    ]
    differing = [(a, b) for a, b in texts if a != b]
    prefix = [common_prefix(a, b) / max(len(a), 1) for a, b in differing]
    result = {
        "rows": len(rows_a),
        "identical_rows": len(rows_a) - len(differing),
        "differing_rows_mean_shared_prefix": round(sum(prefix) / len(prefix), 3)
        if prefix
        else None,
        "tokens_per_s_a": tokens_per_s(log_a),
        "tokens_per_s_b": tokens_per_s(log_b),
    }
    a, b = result["tokens_per_s_a"], result["tokens_per_s_b"]
    result["speedup_b_over_a"] = round(b / a, 3) if a and b else None
    print(json.dumps(result))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "generate-attn-check.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
