"""Check on a GPU that `data.prefetch_to_device` (stage2_train/prefetch.py) trains exactly like
fetching in turn: the same sequences in the same steps and the same losses, on a small
synthetic store (tests/store_factory.py), the SDPA attention path (no compile: seconds).

    python bench/prefetch_check.py            # GPU 0; prints one JSON line, exit 1 on a mismatch
    python bench/prefetch_check.py --measure  # then the real loop at the pystd recipe's shape
    python bench/prefetch_check.py --measure --device cpu --steps 6 --warmup 2   # CPU smoke

--measure times `dflash train`'s real loop (loader workers, compiled flex attention) on a
synthetic store of the pystd recipe's shape (3,072-token sequences of 200-640-token documents,
5 tapped layers of 384, vocab 8,192, top-32; configs/pystd.yaml's drafter and batch) with the
option on and off: median step seconds after warm-up, and their ratio ($OUT/prefetch.jsonl).

The side stream's copies can only race on a GPU, which the CPU tests cannot show; run this
before turning the option on by default (it is off until a GPU run has passed this check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from jsonl import emit_to  # noqa: E402
from store_factory import FactorySpec, build_store  # noqa: E402

from common.config import build_config  # noqa: E402
from stage2_train.config import TrainConfig  # noqa: E402
from stage2_train.train import run_train  # noqa: E402

TIMING = {"compute_s", "fetch_s", "queue_s", "step_s", "tokens_per_s", "mem_gb"}


PYSTD_STORE = FactorySpec(
    num_sequences=96,
    seq_len=3072,
    sequences_per_shard=32,
    hidden_size=384,
    tapped_layers=[1, 3, 5, 7, 8],
    vocab_size=8192,
    topk=32,
    num_attention_heads=6,
    num_key_value_heads=2,
    min_doc_len=200,
    max_doc_len=640,
    prompt_len=16,
    chunk_tokens=3072,
    mask_token_id=3,
)


emit = emit_to("prefetch.jsonl")


def measure(steps: int, warmup: int, device: str) -> bool:
    """The real loop at the pystd shape, the option on then off; median step seconds. On the
    CPU (a smoke run of this script) a small store and configs/debug.yaml."""
    work = Path(tempfile.mkdtemp(prefix="prefetch-measure-"))
    cpu = device == "cpu"
    store = build_store(work / "store", FactorySpec(num_sequences=13) if cpu else PYSTD_STORE)
    medians, rows = {}, {}
    for on in (True, False):
        sets = [
            f"data.store={store}",
            f"run.out={work / f'run-{on}'}",
            "run.progress=false",
            f"run.devices={device}",
            f"optim.max_steps={steps}",
            "optim.epochs=1000",
            f"data.holdout_sequences={2 if cpu else 8}",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            f"data.prefetch_to_device={str(on).lower()}",
            *([] if cpu else ["drafter.intermediate_size=1536"]),  # pystd-28m's (the factory: 2x)
        ]
        config = ROOT / "configs" / ("debug.yaml" if cpu else "pystd.yaml")
        cfg = build_config(TrainConfig, config, "train", sets)
        run_train(cfg)
        rows[on] = [json.loads(x) for x in (work / f"run-{on}" / "metrics.jsonl").open()]
        steady = rows[on][warmup:]
        medians[on] = statistics.median(r["step_s"] for r in steady)
        record = {"measure": "train_loop", "shape": "tiny" if cpu else "pystd",
                  "prefetch_to_device": on, "steps": len(steady),
                  "median_step_ms": round(1000 * medians[on], 2)}  # fmt: skip
        if on:  # the host time of the fetch that overlapped each step (the last has none)
            record["median_fetch_ms"] = round(
                1000 * statistics.median(r["fetch_s"] for r in steady if "fetch_s" in r), 2
            )
        emit(record)
    # at this shape too (mask tables, compiled flex): the same sequences and losses
    on, off = rows[True], rows[False]
    same = [r["seqs"] for r in on] == [r["seqs"] for r in off]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(on, off, strict=True))
    emit({"measure": "train_loop", "on_vs_off": round(medians[True] / medians[False], 4),
          "same_sequences": same, "max_loss_diff": diff})  # fmt: skip
    return same and diff < 1e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="then time the pystd-shape loop")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="0", help="a GPU id, or cpu (a smoke run)")
    args = parser.parse_args()
    ok = check(args.device)
    if ok and args.measure:
        ok = measure(args.steps, args.warmup, args.device)
    sys.exit(0 if ok else 1)


def check(device: str) -> bool:
    work = Path(tempfile.mkdtemp(prefix="prefetch-check-"))
    store = build_store(work / "store", FactorySpec(num_sequences=13))
    runs = {}
    for on in (True, False):
        sets = [
            f"data.store={store}",
            f"run.out={work / f'run-{on}'}",
            "run.progress=false",
            f"run.devices={device}",
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
    emit(result)
    return bool(result["ok"])


if __name__ == "__main__":
    main()
