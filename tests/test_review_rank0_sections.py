"""A failure in a section that rank 0 does alone under torchrun reaches every rank at once,
named: `dflash generate` checking and preparing the output folder (and every rank reading the
inputs), generating (every rank), finalizing the manifest; `dflash extract` planning and preparing the store, writing the target
head file, marking the store complete; `dflash train` opening its metrics
and trackers, writing a step's metrics line (every step), evaluating on the dev store and
exporting the best drafter, exporting at the end.
The other ranks used to wait in the barrier or all-reduce after it until the process-group
timeout (48 hours for generate, two hours for train), or to end as if the run had succeeded
(generate's finalize). Two gloo ranks under a short timeout, so a regression fails in seconds
instead of hanging; each rank's process group outlives its failure (finish_worker is not
called), as a rank on another node sees nothing of a failed one but its silence."""

from __future__ import annotations

import errno
import json
import multiprocessing
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_pair import run_in_pair
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.distributed import WorkerContext
from stage1_generate.config import GenerateConfig
from stage2_train.best import BEST_DIR
from stage2_train.config import TrainConfig
from stage2_train.metrics import MetricsWriter

TIMEOUT_S = 8.0  # slower ranks (model loads, 2 shared cores) must not time out legitimately
DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
CONVERSATIONS = [
    [{"role": "user", "content": f"Say {word}."}, {"role": "assistant", "content": word}]
    for word in ("hi", "yes", "no", "blue", "red")
]
# what rank 0 is made to fail at; a fragment of its error that every rank must name
GENERATE = {
    "check": "is a file; pass a folder path",  # --out is a file: rank 0 alone checks it
    "chunk": "No space left on device",  # committing its chunk (rank 1 writes its own)
    "finalize": "No space left on device",  # the manifest's totals, after every chunk
}
EXTRACT = {
    "prepare": "No space left on device",  # rank 0 alone plans, locks and prepares the store
    "head": "No space left on device",  # its target head file, beside its shards
    "finalize": "No space left on device",  # the complete mark, after every shard
}
TRAIN = {
    "metrics": "line 1 is not a JSON record",  # truncating RUN/metrics.jsonl as it starts
    "step": "No space left on device",  # a step's metrics line, between two plain steps
    "best": "No space left on device",  # exporting the best drafter after a dev evaluation
    "final": "No space left on device",  # the export at the end
}


def _no_space(path: object) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _meet(root: Path, name: str, rank: int) -> None:
    """Wait for the other rank to reach `name` too, through files (no collective)."""
    (root / f"{name}-{rank}").touch()
    deadline = time.monotonic() + 60
    while not (root / f"{name}-{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class Interrupted(Exception):
    """A KeyboardInterrupt out of a stage's run, as `_in_group` reports only Exceptions."""


def interruptible(run: Any) -> Any:
    """`run` (a stage's run_extract / run_generate) with a KeyboardInterrupt raised as
    Interrupted, which `_in_group` reports."""

    def body(cfg: Any) -> None:
        try:
            run(cfg)
        except KeyboardInterrupt as err:
            raise Interrupted("KeyboardInterrupt") from err

    return body


def _in_group(root: Path, name: str, rank: int, body: Any, *args: Any) -> tuple[str, float]:
    """`body(*args)` as rank `rank` of 2 in a process group of its own, which both ranks leave
    together (a rank that failed alone would otherwise meet the other in the next scenario's
    collectives); its error (or "none") and seconds."""
    store = dist.FileStore(str(root / f"store-{name}"), 2)
    timeout = timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    started = time.perf_counter()
    try:
        body(*args)
        error = "none"
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    took = time.perf_counter() - started
    _meet(root, f"done-{name}", rank)
    dist.destroy_process_group()
    return error, took


def _generate_rank(rank: int, root: Path, cfg: GenerateConfig, seen: Any) -> None:
    import stage1_generate.run as generate_run

    outcomes = {}
    with pytest.MonkeyPatch.context() as patch:
        _as_torchrun_rank(patch, rank, generate_run)
        for scenario in GENERATE:
            out = root / ("check" if scenario == "check" else "out")
            with pytest.MonkeyPatch.context() as fail:
                if rank == 0 and scenario == "chunk":
                    fail.setattr(generate_run, "write_chunk", lambda out, *a: _raise(out))
                if rank == 0 and scenario == "finalize":
                    fail.setattr(generate_run, "finalize_output", lambda out, *a: _raise(out))
                run = generate_run.run_generate
                outcomes[scenario] = _in_group(
                    root, scenario, rank, run, _with_out(cfg, "output", out)
                )
    seen.put((rank, outcomes))


def _raise(path: object) -> None:
    raise _no_space(path)


def _as_torchrun_rank(patch: pytest.MonkeyPatch, rank: int, command: Any) -> None:
    """This process as rank `rank` of 2 under torchrun, on a node of its own; `command`'s
    module keeps its process group after a failure (see the module docstring)."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_RANK", rank)):
        patch.setenv(name, str(value))
    patch.setenv("LOCAL_WORLD_SIZE", "1")
    patch.setattr(command, "finish_worker", lambda: None)


def _with_out(cfg: Any, section: str, out: Path) -> Any:
    """`cfg` with its `section`'s `out` set to `out`."""
    import dataclasses

    changed = dataclasses.replace(getattr(cfg, section), out=str(out))
    return dataclasses.replace(cfg, **{section: changed})


def _wait_for(path: Path) -> None:
    """Until `path` exists (a minute at most: the assertions after it then fail, named)."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _run_ranks(
    target: Any, root: Path, *args: Any, reports: int = 2, own_processes: bool = False
) -> dict[int, Any]:
    """`target(rank, root, *args, seen)` as two spawned ranks; the (rank, outcome) pairs that
    `reports` of them put on `seen`. The ranks are the session's pair (tests/rank_pair.py),
    unless `own_processes`: two fresh processes, for a target whose rank ends its process."""
    if not own_processes:
        return run_in_pair(target, root, *args, reports=reports)
    spawn = multiprocessing.get_context("spawn")
    seen = spawn.Queue()
    ranks = [spawn.Process(target=target, args=(r, root, *args, seen)) for r in range(2)]
    for rank in ranks:
        rank.start()
    try:
        return dict(seen.get(timeout=120) for _ in range(reports))
    finally:
        for rank in ranks:
            rank.join(timeout=10)
            if rank.is_alive():  # a safety net only
                rank.kill()


def _check(outcomes: dict[int, dict[str, tuple[str, float]]], expected: dict[str, str]) -> None:
    for scenario, said in expected.items():
        own, _ = outcomes[0][scenario]
        told, _ = outcomes[1][scenario]
        assert said in own and "RankFailed" not in own, (scenario, own)
        assert told.startswith("RankFailed: rank 0 failed") and said in told, (scenario, told)


def test_generate_stops_every_rank_when_rank_0_fails(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    (tmp_path / "check").write_text("not a folder")
    flags = [f"target.model={tiny_qwen3}", f"data.path={data}", "output.out=unset"]
    flags += ["run.progress=false", "sampling.max_new_tokens=4", "output.rows_per_chunk=2"]
    cfg = build_config(GenerateConfig, DEBUG, "generate", flags)
    outcomes = _run_ranks(_generate_rank, tmp_path, cfg)
    _check(outcomes, GENERATE)
    # chunks 0, 2 (rank 0: refused, then committed by the finalize scenario) and 1 (rank 1)
    assert len(list((tmp_path / "out").glob("part-*.jsonl.gz"))) == 3
    manifest = json.loads((tmp_path / "out" / ".dflash-generate" / "manifest.json").read_text())
    assert not manifest.get("complete")


def _extract_rank(rank: int, root: Path, cfg: Any, seen: Any) -> None:
    import stage1_extract.run as extract_run

    outcomes = {}
    with pytest.MonkeyPatch.context() as patch:
        _as_torchrun_rank(patch, rank, extract_run)
        for scenario in EXTRACT:
            with pytest.MonkeyPatch.context() as fail:
                if rank == 0 and scenario == "prepare":
                    fail.setattr(extract_run, "prepare_store", lambda store, *a: _raise(store))
                if rank == 0 and scenario == "head":
                    fail.setattr(extract_run, "save_target_head", lambda m, path, *a: _raise(path))
                if rank == 0 and scenario == "finalize":
                    fail.setattr(extract_run, "finalize_store", lambda store, *a: _raise(store))
                run = extract_run.run_extract
                out = root / f"extract-{scenario}"
                outcomes[scenario] = _in_group(
                    root, scenario, rank, run, _with_out(cfg, "store", out)
                )
    seen.put((rank, outcomes))


def test_extract_stops_every_rank_when_rank_0_fails(tiny_qwen3: Path, tmp_path: Path) -> None:
    from test_extract import make_config, write_data

    cfg = make_config(tiny_qwen3, write_data(tmp_path, 4), tmp_path / "unset", "run.progress=false")
    outcomes = _run_ranks(_extract_rank, tmp_path, cfg)
    _check(outcomes, EXTRACT)
    assert not (tmp_path / "extract-finalize" / "zarr.json").exists() or not json.loads(
        (tmp_path / "extract-finalize" / "zarr.json").read_text()
    )["attributes"].get("complete")


def _train_rank(rank: int, root: Path, configs: dict[str, TrainConfig], seen: Any) -> None:
    import stage2_train.train as train

    export, outcomes = train.export_drafter, {}
    ctx = WorkerContext(rank, 2, rank, torch.device("cpu"))

    def export_refused(*args: Any, **kwargs: Any) -> Path:
        folder = Path(args[4])
        if folder.name in (BEST_DIR, "export"):
            raise _no_space(folder / "model.safetensors")
        return export(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "draw_plots_safely", lambda out: None)  # seconds of matplotlib
        patch.setattr(train, "chained_tau_on_store", lambda *a, **k: {"chained_tau": 2.0})
        if rank == 0:
            patch.setattr(train, "export_drafter", export_refused)
        for scenario, cfg in configs.items():
            with pytest.MonkeyPatch.context() as fail:
                if rank == 0 and scenario == "step":
                    fail.setattr(MetricsWriter, "write", _line_refused)
                run = train.train_worker
                outcomes[scenario] = _in_group(root, scenario, rank, run, cfg, ctx)
    seen.put((rank, outcomes))


def _line_refused(writer: MetricsWriter, record: dict[str, Any]) -> None:
    """Step 1's line fails as a full disk would. It is written once step 2 is queued
    (run.read_metrics_late); the failure rides on step 2's stop agreement, read late, at step
    3: rank 1 trains steps 2 and 3 meanwhile, and used to wait in step 3's collectives."""
    if record["step"] == 1:
        raise _no_space(writer.path)


def test_train_stops_every_rank_when_rank_0_fails(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=9))
    configs = {}
    for scenario in TRAIN:
        out = tmp_path / scenario
        sets = [f"data.store={store}", f"run.out={out}", "run.progress=false"]
        sets += ["data.holdout_sequences=2", "optim.max_steps=2", "run.eval_every=1"]
        if scenario == "step":  # plain steps after the failed line (no evaluation, no
            # checkpoint: the ranks meet only in the step's collectives); step 3 reads the
            # agreement, so it must not be the last (the last step asks none)
            sets += ["optim.max_steps=4", "run.eval_every=0"]
        if scenario == "best":
            sets += [f"data.dev_store={store}", "run.export_best=true"]
        configs[scenario] = build_config(TrainConfig, DEBUG, "train", sets)
        out.mkdir()  # as run_train makes it
        if scenario == "metrics":  # a line damaged by hand: rank 0 refuses it
            (out / "metrics.jsonl").write_text('{"step": \n{"step": 1}\n')
    outcomes = _run_ranks(_train_rank, tmp_path, configs)
    _check(outcomes, TRAIN)
    assert not (tmp_path / "best" / "step-000001").exists()  # every rank stopped at step 1
    assert (tmp_path / "final" / "step-000002" / "meta.json").is_file()
    assert not list((tmp_path / "step").glob("step-*"))  # every rank stopped before the end
