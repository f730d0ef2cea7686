"""The loss of an optimizer step is one per-token mean over the global batch (train.py,
trainstep.py): 2 gloo ranks x 1 sequence and 1 rank x 2 micro-batches of 1 give the step of
1 rank x 2 sequences, with the D-PACE weights and the distillation term on. The sequences'
labelled slots differ in number: a mean of per-rank means (each rank's loss normalised by its
own weights) fails this test."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from store_factory import FactorySpec, build_store

from dflash_offline.cli import main as cli

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
KEYS = (
    "loss",
    "ce",
    "distill",
    "grad_norm",
    "acc",
    "lr",
    "tokens",
    "eval_blocks",
    "eval_loss",
    "eval_tau",
    "eval_acc",
)


def train(store: Path, out: Path, devices: str, *sets: str) -> list[dict]:
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", devices]
    base = ["optim.max_steps=2", "run.progress=false", "data.holdout_sequences=3"]
    base += ["loss.weighting=dpace", "loss.distill_weight=0.5", "loss.distill_temperature=2"]
    for s in [*base, *sets]:
        args += ["--set", s]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_ranks_and_accumulation_give_the_step_of_one_batch(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=7, min_doc_len=6))
    whole = train(store, tmp_path / "b2", "cpu", "optim.batch_sequences=2")
    accum = train(store, tmp_path / "accum", "cpu", "optim.grad_accum=2")
    ranks = train(store, tmp_path / "ranks", "cpu,cpu")
    # the same sequences each step, with other numbers of labelled slots
    assert [r["seqs"] for r in accum] == [[sum(r["seqs"], [])] for r in ranks]
    assert [sum(r["seqs"], []) for r in whole] == [sum(r["seqs"], []) for r in accum]
    for a, b, c in zip(whole, accum, ranks, strict=True):
        for key in KEYS:
            if key in a:
                for other in (b, c):
                    torch.testing.assert_close(
                        other[key],
                        a[key],
                        rtol=2e-5,
                        atol=1e-6,
                        msg=f"{key}: {other[key]} vs {a[key]}",
                    )
    assert "eval_tau" in whole[-1]
