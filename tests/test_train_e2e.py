"""`dflash train` end to end on the CPU: it learns, resumes exactly, runs data parallel over two
gloo processes, and trains from a store written by the real `dflash extract`."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.store import HEAD_FILE, open_store
from dflash_offline.cli import main as cli
from stage2_train.config import TrainConfig
from stage2_train.data import Batch, DamageGuard
from stage2_train.export import export_checkpoint, load_export
from stage2_train.model import DFlashDrafter, DrafterShape
from stage2_train.plan import PlanSampler
from stage2_train.train import run_train
from stage2_train.trainstep import StepRunner

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
TIMING = {"compute_s", "fetch_s", "queue_s", "step_s", "tokens_per_s", "mem_gb"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("e2e") / "store", FactorySpec(num_sequences=13))


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return read_metrics(out)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_learns_and_exports(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = train(store, out, "optim.epochs=4", "run.eval_every=11", "data.holdout_sequences=2")
    assert [r["step"] for r in rows] == list(range(1, 45))  # 11 sequences x 4 epochs
    first = sum(r["loss"] for r in rows[:8]) / 8
    last = sum(r["loss"] for r in rows[-8:]) / 8
    assert last < 0.5 * first, (first, last)
    evals = [r for r in rows if "eval_tau" in r]
    assert [r["step"] for r in evals] == [11, 22, 33, 44]
    assert sum(evals[-1]["eval_acc"]) > sum(evals[0]["eval_acc"]) + 1.0
    assert evals[-1]["eval_tau"] > 1.5 and len(evals[-1]["eval_acc"]) == 7
    assert sum(rows[-1]["acc"]) > sum(rows[0]["acc"]) + 1.0
    for key in ("lr", "grad_norm", "tokens_per_s", "seqs"):
        assert key in rows[-1]
    # The export holds the final weights: reload it and compare with the last checkpoint.
    meta = json.loads((out / "step-000044" / "meta.json").read_text())
    model = DFlashDrafter(DrafterShape(**meta["shape"]))
    model.load_state_dict(torch.load(out / "step-000044" / "model.pt", weights_only=True))
    exported = load_export(out / "export")  # bf16 by default, like the targets served
    on_demand = load_export(export_checkpoint(out, step=44, out=tmp_path / "again"))
    exact = load_export(export_checkpoint(out, 44, tmp_path / "fp32", dtype="float32"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.bfloat16(), exported.state_dict()[name]), name
        assert torch.equal(tensor.bfloat16(), on_demand.state_dict()[name]), name
        assert torch.equal(tensor, exact.state_dict()[name]), name


def test_resume_equals_uninterrupted(store: Path, tmp_path: Path) -> None:
    sets = [
        "optim.max_steps=8",
        "run.checkpoint_every=4",
        "run.keep_checkpoints=5",
        "run.eval_every=4",
        "optim.grad_accum=2",
        "optim.batch_sequences=2",
    ]
    out = tmp_path / "run"
    full = train(store, out, *sets)
    assert len(full) == 8 and full[-1]["epoch"] == 2  # 11 sequences / 4 per step: epochs roll
    # "Kill" after step 6: drop what a run stopped there would not have written.
    shutil.rmtree(out / "step-000008")
    shutil.rmtree(out / "export")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:6]))
    resumed = train(store, out, *sets)  # resumes from step-000004

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert strip(resumed) == strip(full)
    assert (out / "export" / "model.safetensors").is_file()
    again = train(store, out, *sets)  # finished run: nothing is retrained
    assert strip(again) == strip(full)
    # another batch layout would give the saved data position another meaning
    with pytest.raises(ValueError, match="optim.batch_sequences"):
        train(store, out, *sets, "optim.batch_sequences=1")
    # the store is known by its content: the same store at another path resumes (a finished
    # run re-exports), another extraction at any path is refused
    moved = Path(shutil.copytree(store, tmp_path / "moved-store"))
    assert strip(train(moved, out, *sets)) == strip(full)
    other = build_store(tmp_path / "other-store", FactorySpec(num_sequences=13, seed=7))
    with pytest.raises(ValueError, match="content key"):
        train(other, out, *sets)


def test_metrics_read_late_match_read_at_once(store: Path, tmp_path: Path) -> None:
    """run.read_metrics_late writes the same lines, and checkpoints the same state, as reading
    each step's metrics at once: only their timing fields differ."""
    sets = ["optim.max_steps=8", "run.eval_every=4", "run.checkpoint_every=3", "run.log_every=1"]
    sets += ["run.keep_checkpoints=3"]
    late = train(store, tmp_path / "late", *sets)
    at_once = train(store, tmp_path / "at-once", *sets, "run.read_metrics_late=false")

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert [r["step"] for r in late] == list(range(1, 9))
    assert strip(late) == strip(at_once)
    for step in ("step-000003", "step-000006", "step-000008"):
        states = [
            json.loads((tmp_path / run / step / "meta.json").read_text())["train_state"]
            for run in ("late", "at-once")
        ]
        assert states[0] == states[1] and states[0]["tokens_seen"] > 0


def test_metrics_read_late_count_each_step_once(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step read late ends where the next one began: its step_s does not also hold the next
    step's queueing (which made every step_s ~2x the wall time per step)."""
    queue = StepRunner.queue

    def slow_queue(self: StepRunner, *args: object, **kwargs: object) -> object:
        time.sleep(0.5)  # on the CPU queueing runs the step: each step takes >= 0.5 s
        return queue(self, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "queue", slow_queue)
    rows = train(store, tmp_path / "late", "optim.max_steps=6", "run.eval_every=0")
    read_late = [r["step_s"] for r in rows[:-1]]  # the last step is read at once
    assert all(s >= 0.5 for s in read_late), read_late
    assert sorted(read_late)[len(read_late) // 2] < 0.9, read_late  # counted twice: >= 1.0


@pytest.fixture(scope="module")
def two_rank_runs(store: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """`dflash train --devices cpu,cpu` for one epoch, reading each step's metrics late (the
    default) and at once: the folder of both runs (late-True, late-False) and their metrics
    lines without the timing fields. Both tests below read them: each launch of two gloo
    processes costs seconds of start-up."""
    root = tmp_path_factory.mktemp("two-ranks")
    sets = ["optim.epochs=1", "run.eval_every=2", "run.checkpoint_every=2", "run.log_every=1"]
    sets += ["run.progress=false", "data.holdout_sequences=2"]
    rows = {}
    for late in (True, False):
        out = root / f"late-{late}"
        args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
        args += ["--devices", "cpu,cpu"]
        for s in [*sets, f"run.read_metrics_late={str(late).lower()}"]:
            args += ["--set", s]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        rows[late] = [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(out)]
    return root, rows


def test_two_gloo_processes_disjoint_data_identical_weights(two_rank_runs) -> None:
    root, runs = two_rank_runs
    out = root / "late-True"  # as the default runs
    rows = runs[True]
    assert len(rows) == 6  # 11 training sequences over 2 ranks: 6 steps, one padding item
    seen = [r["seqs"] for r in rows]
    rank0 = [i for step in seen for i in step[0]]
    rank1 = [i for step in seen for i in step[1]]
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == [-1, *range(11)]
    meta = json.loads((out / "step-000006" / "meta.json").read_text())
    sums = meta["replica_fingerprints"]
    assert len(sums) == 4 and sums[0:2] == sums[2:4]
    assert "eval_tau" in rows[-1] and (out / "export" / "config.json").is_file()


def test_two_ranks_read_late_write_what_reading_at_once_writes(two_rank_runs) -> None:
    """With several ranks run.read_metrics_late reads the metrics (and the stop agreement) a
    step later; the lines and the checkpoints are those of reading at once."""
    root, rows = two_rank_runs
    assert [r["step"] for r in rows[True]] == list(range(1, 7))
    assert rows[True] == rows[False]
    for step in ("step-000004", "step-000006"):  # the newest two are kept
        metas = [
            json.loads((root / f"late-{late}" / step / "meta.json").read_text())
            for late in (True, False)
        ]
        assert metas[0]["train_state"] == metas[1]["train_state"]
        assert metas[0]["replica_fingerprints"] == metas[1]["replica_fingerprints"]


def test_train_from_a_real_extracted_store(tiny_qwen3: Path, tmp_path: Path) -> None:
    from common.tiny import EXAMPLE_DATA
    from stage1_extract.config import ExtractConfig
    from stage1_extract.run import run_extract

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(EXAMPLE_DATA.read_text().splitlines()[:24]) + "\n")
    extract = build_config(
        ExtractConfig,
        DEBUG,
        "extract",
        [
            f"target.model={tiny_qwen3}",
            f"data.path={data}",
            f"store.out={tmp_path / 'store'}",
            "packing.seq_len=64",
            "store.sequences_per_shard=4",
            "store.chunk_tokens=32",
            "run.progress=false",
        ],
    )
    run_extract(extract)
    rows = train(tmp_path / "store", tmp_path / "run", "optim.max_steps=12", "run.eval_every=6")
    assert len(rows) == 12 and all(r["loss"] == r["loss"] for r in rows)  # finite, no NaN
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])
    assert rows[-1]["eval_tau"] >= 1.0
    config = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    tapped = open_store(tmp_path / "store").tapped_layers
    assert config["dflash_config"]["target_layer_ids"] == tapped and len(tapped) == 3
    assert config["num_target_layers"] == 4
    assert_every_parameter_learns(tmp_path / "store")


def assert_every_parameter_learns(store: Path) -> None:
    """One real batch, forward + backward: every trainable tensor gets a nonzero gradient.
    (A zero mask-token embedding once gave q/k projections and norms exactly zero gradient; one
    layer, so that no later layer's attention to the anchor slot can hide it.)"""
    from stage2_train.anchors import slot_weights
    from stage2_train.data import StoreSequences, collate
    from stage2_train.inputs import check_inputs
    from stage2_train.loss import chunked_block_loss
    from stage2_train.step import forward_batch, load_frozen_head

    sets = [f"data.store={store}", "run.out=unused", "drafter.num_layers=1"]
    cfg = build_config(TrainConfig, DEBUG, "train", sets)
    info, shape = check_inputs(cfg)
    head = load_frozen_head(store, torch.device("cpu"), torch.float32)
    model = DFlashDrafter(shape)
    sequences = StoreSequences(
        info,
        num_anchors=cfg.anchors.num_anchors,
        per_document=False,
        block_size=shape.block_size,
        label_target="argmax",
        distill=False,
        seed=0,
    )
    batch = collate([sequences[(0, 0, False)], sequences[(1, 0, False)]])
    hidden_QD = forward_batch(
        model,
        head,
        batch,
        block_size=shape.block_size,
        mask_token_id=shape.mask_token_id,
        backend="sdpa",
    )
    weights_AB = batch.weights_AB * slot_weights(shape.block_size)[None]
    loss, _ = chunked_block_loss(hidden_QD, head.lm_head_VD, batch.labels_AB, weights_AB, 64)
    loss.backward()
    silent = [n for n, p in model.named_parameters() if not p.grad.abs().max() > 0]
    assert not silent, f"no gradient reaches {silent}"


def test_learns_what_only_the_anchor_token_carries(tmp_path: Path) -> None:
    """Labels are a fixed permutation of the anchor token and the features are noise: only the
    anchor slot of the block can give the answer. A mask that hid the block's own slots, or
    labels shifted by one, would leave slot-1 accuracy at chance (~1/44)."""
    import zarr

    from common.store import bf16_to_bits
    from common.store_files import record_shard_files

    store = build_store(tmp_path / "store", FactorySpec(num_sequences=40, sequences_per_shard=10))
    noise = torch.Generator().manual_seed(1)
    for shard in sorted((store / "shards").iterdir()):
        hidden = zarr.open_group(shard, mode="r+")["hidden"]
        hidden[...] = bf16_to_bits(torch.randn(hidden.shape, generator=noise).bfloat16())
        record_shard_files(shard)  # the store's own writer records the sizes after any write
    rows = train(
        store,
        tmp_path / "run",
        "data.holdout_sequences=4",
        "optim.max_steps=400",
        "optim.epochs=40",
        "optim.lr=3e-3",
        "anchors.num_anchors=16",
        "drafter.num_layers=2",
        "run.eval_every=0",
        "run.checkpoint_every=0",
    )
    final = rows[-1]
    assert final["eval_acc"][0] > 0.3, final["eval_acc"]  # chance: 1/44
    # slot k's label is the anchor's k-th successor: mask slots must know which slot they are
    assert min(final["eval_acc"][:5]) > 0.3, final["eval_acc"]  # measured: 0.73-0.96
    assert final["eval_tau"] > 1.8, final["eval_tau"]


def test_mixed_precision_keeps_fp32_master_weights(store: Path, tmp_path: Path) -> None:
    """run.dtype=mixed: fp32 parameters and AdamW states, bf16 compute; it learns like fp32."""
    out = tmp_path / "run"
    sets = ["optim.epochs=4", "run.eval_every=0", "data.holdout_sequences=2"]
    rows = train(store, out, *sets, "run.dtype=mixed")
    first = sum(r["loss"] for r in rows[:8]) / 8
    last = sum(r["loss"] for r in rows[-8:]) / 8
    assert last < 0.5 * first, (first, last)
    reference = train(store, tmp_path / "fp32", *sets, "run.dtype=float32")
    assert abs(rows[-1]["loss"] - reference[-1]["loss"]) < 0.15 * reference[-1]["loss"]
    assert rows[-1]["loss"] != reference[-1]["loss"]  # bf16 compute really ran
    ckpt = out / f"step-{rows[-1]['step']:06d}"
    weights = torch.load(ckpt / "model.pt", weights_only=True)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    states = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert {s["exp_avg"].dtype for s in states.values()} == {torch.float32}
    assert rows[-1]["eval_tau"] >= 1.0  # held-out evaluation ran under autocast too
    # why mixed is the default: fp32 master weights let the RMSNorm weights (~1.0) move, while
    # bf16 weights round every update below half an ulp (0.004 above 1.0) away, at lr 6e-4 all
    moved = {k: float((v - 1).abs().max()) for k, v in weights.items() if "norm" in k}
    assert min(moved.values()) > 0, moved
    train(store, tmp_path / "bf16", "optim.max_steps=8", "optim.lr=6e-4", "run.dtype=bfloat16")
    bf16 = torch.load(tmp_path / "bf16" / "step-000008" / "model.pt", weights_only=True)
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in bf16.items() if "norm" in k)


@pytest.mark.parametrize("from_target", [True, False])
def test_final_norm_starts_at_the_targets(tmp_path: Path, from_target: bool) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=3))
    head_path = store / HEAD_FILE
    head = load_file(head_path)
    head["norm.weight"] = torch.linspace(0.5, 2.5, head["norm.weight"].numel()).bfloat16()
    save_file(head, str(head_path), metadata={"rms_norm_eps": "1e-06"})
    # lr ~ 0: the exported norm is the initial one (the warmup's first step moves nothing)
    sets = ["optim.max_steps=1", "optim.lr=1e-12", f"drafter.init_norm_from_target={from_target}"]
    train(store, tmp_path / "run", *sets)
    norm = load_export(tmp_path / "run" / "export").norm.weight.float()
    expected = head["norm.weight"].float() if from_target else torch.ones_like(norm)
    torch.testing.assert_close(norm, expected, rtol=0, atol=1e-6)


def test_dpace_weighting_trains(store: Path, tmp_path: Path) -> None:
    rows = train(store, tmp_path / "run", "optim.epochs=4", "loss.weighting=dpace")
    first = sum(r["loss"] for r in rows[:8]) / 8
    last = sum(r["loss"] for r in rows[-8:]) / 8
    assert last < 0.5 * first, (first, last)
    assert sum(rows[-1]["acc"]) > sum(rows[0]["acc"]) + 1.0


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_compiled_layers_train_like_eager(store: Path, tmp_path: Path, cuda_graphs: bool) -> None:
    """run.cuda_graphs compiles the layers in reduce-overhead mode: on the CPU (no CUDA graphs
    to replay, and no step marks: those run on a GPU only) the same training as eager."""
    sets = ["optim.max_steps=4", "run.eval_every=0", "data.holdout_sequences=2"]
    eager = train(store, tmp_path / "eager", *sets)
    compiled = train(
        store,
        tmp_path / "compiled",
        *sets,
        "run.compile_layers=true",
        f"run.cuda_graphs={str(cuda_graphs).lower()}",
    )
    for a, b in zip(eager, compiled, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["loss"], b["loss"])
    names = torch.load(tmp_path / "compiled" / "step-000004" / "model.pt", weights_only=True)
    assert not any("_orig_mod" in name for name in names)


def test_evaluate_offline_on_a_store(store: Path, tmp_path: Path) -> None:
    rows = train(store, tmp_path / "run", "optim.epochs=4", "data.holdout_sequences=2")
    export = tmp_path / "run" / "export"
    out = tmp_path / "offline.json"
    args = ["evaluate-offline", "--drafter", str(export), "--store", str(store)]
    result = CliRunner().invoke(cli, [*args, "--num-anchors", "16", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["sequences"] == 13 and len(figures["eval_acc"]) == 7
    # learnt on 11 of these 13 sequences: at least as good as on the 2 held out
    assert figures["eval_tau"] > 1.5 and figures["eval_tau"] >= 0.9 * rows[-1]["eval_tau"]
    # a store of other tapped layers is refused with the reason
    other = build_store(tmp_path / "other", FactorySpec(num_sequences=3, tapped_layers=[1, 3]))
    result = CliRunner().invoke(
        cli, ["evaluate-offline", "--drafter", str(export), "--store", str(other)]
    )
    assert result.exit_code == 2 and "the drafter reads layers" in result.output
    result = CliRunner().invoke(cli, [*args[:2], str(tmp_path), "--store", str(store)])
    assert result.exit_code == 2 and "config.json, model.safetensors missing" in result.output


def test_prefetching_the_next_step_changes_nothing(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fetching the next step's batches while a step runs (stage2_train/prefetch.py) reads the
    same sequences in the same steps, across epoch ends, with loader workers, as pulling them
    at the top of each step: same metrics, same weights. Each run opens one loader iterator
    (its workers read on across the epoch ends)."""
    opened = []  # the training loader's iterators (torch's own asks its sampler for two)
    iterate = DamageGuard.__iter__

    def counted(guard: DamageGuard) -> Iterator[Batch]:
        opened.extend([1] if isinstance(guard.loader.batch_sampler, PlanSampler) else [])
        return iterate(guard)

    monkeypatch.setattr(DamageGuard, "__iter__", counted)
    sets = [
        "optim.max_steps=8",
        "optim.grad_accum=2",
        "optim.batch_sequences=2",
        "data.num_workers=2",
        "run.eval_every=4",
    ]
    prefetched = train(store, tmp_path / "prefetched", *sets, "data.prefetch_to_device=true")
    in_turn = train(store, tmp_path / "in-turn", *sets, "data.prefetch_to_device=false")

    def strip(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert in_turn[-1]["epoch"] == 2  # both epoch ends are inside the run
    assert len(opened) == 2  # one iterator a run
    assert strip(prefetched) == strip(in_turn)
    weights = [load_file(tmp_path / run / "export" / "model.safetensors") for run in
               ("prefetched", "in-turn")]  # fmt: skip
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
