"""Python garbage-collector pauses of a `dflash` command: count, total and longest pause per
generation, and the live objects at the end (CPython's gc.callbacks).

    python bench/gc_pauses.py train --config configs/pystd.yaml --store STORE --out RUN ...
    python bench/gc_pauses.py extract --config configs/pystd.yaml --model M --data D --out S ...

Any `dflash` command line after the script's name; one JSON line on stderr at the end (also to
$OUT/gc-pauses.json). Why: a full (generation 2) collection walks every live object, and a
host-bound training step waits it out; `run.gc_every` schedules them (stage2_train/gc_schedule.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

from dflash_offline.cli import main as cli


def main() -> None:
    pauses: dict[int, list[float]] = {}
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.setdefault(info["generation"], []).append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_gc)
    try:
        cli(sys.argv[1:], standalone_mode=False)
    finally:
        gc.callbacks.remove(on_gc)
        result = {
            "command": " ".join(sys.argv[1:3]),
            "generations": {
                str(gen): {
                    "count": len(times),
                    "total_ms": round(sum(times) * 1e3, 1),
                    "max_ms": round(max(times) * 1e3, 1),
                }
                for gen, times in sorted(pauses.items())
            },
            "live_objects": len(gc.get_objects()),
        }
        print(json.dumps(result), file=sys.stderr)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            Path(os.environ["OUT"], "gc-pauses.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
