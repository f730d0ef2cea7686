"""Check on a GPU that `data.prefetch_to_device` (stage2_train/prefetch.py) trains exactly like
fetching in turn: the same sequences in the same steps and the same losses, on a small
synthetic store (tests/store_factory.py), the SDPA attention path (no compile: seconds).

    python bench/prefetch_check.py            # GPU 0; prints one JSON line, exit 1 on a mismatch

The side stream's copies can only race on a GPU, which the CPU tests cannot show; run this
before turning the option on by default (it is off until a GPU run has passed this check).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from store_factory import FactorySpec, build_store  # noqa: E402

from common.config import build_config  # noqa: E402
from stage2_train.config import TrainConfig  # noqa: E402
from stage2_train.train import run_train  # noqa: E402

TIMING = {"compute_s", "step_s", "tokens_per_s", "mem_gb"}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="prefetch-check-"))
    store = build_store(work / "store", FactorySpec(num_sequences=13))
    runs = {}
    for on in (True, False):
        sets = [
            f"data.store={store}",
            f"run.out={work / f'run-{on}'}",
            "run.progress=false",
            "run.devices=0",
            "optim.max_steps=8",  # two epoch ends
            "optim.grad_accum=2",
            "optim.batch_sequences=2",
            "data.num_workers=2",
            "run.eval_every=4",
            f"data.prefetch_to_device={str(on).lower()}",
        ]
        run_train(build_config(TrainConfig, ROOT / "configs" / "debug.yaml", "train", sets))
        lines = (work / f"run-{on}" / "metrics.jsonl").read_text().splitlines()
        runs[on] = [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]
    on, off = runs[True], runs[False]
    result = {
        "check": "prefetch_to_device",
        "steps": len(on),
        "same_sequences": [r["seqs"] for r in on] == [r["seqs"] for r in off],
        # GPU kernels may sum in another order from run to run: losses agree closely, not exactly
        "max_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(on, off, strict=True)),
    }
    result["ok"] = result["same_sequences"] and result["max_loss_diff"] < 1e-3
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
