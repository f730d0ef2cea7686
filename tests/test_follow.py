"""`dflash train --follow`: the streamed epoch's plan against a store whose shards appear while
it reads, the wait for a dead extraction, and one end-to-end run beside a real `dflash extract`
that is held at a gate, with a SIGKILL and a resume in the streaming phase."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from store_factory import FactorySpec, build_store
from test_extract import DEBUG, SMALL, write_data

import stage2_train.follow as follow
from common.store import StoreError, committed_shards, open_store, shard_name, shards_dir
from dflash_offline.cli import main as cli
from stage1_extract.store_root import LOCK_FILE
from stage2_train.checkpoint import TrainState
from stage2_train.config import TrainDataConfig
from stage2_train.follow import ExtractionWatch, FollowPlan, check_stream_position
from stage2_train.plan import EpochPlan, PlanSampler

REPO = Path(__file__).parents[1]
REAL_SLEEP = time.sleep


@pytest.fixture
def growing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[int]]:
    """A store of 13 sequences in 5 shards (3, 3, 3, 3, 1) whose shards are moved aside; each
    poll of a waiting stream commits the next one, as a running extraction would. Returns the
    store and the list of the shard counts the stream waited at."""
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=13, sequences_per_shard=3))
    aside = tmp_path / "aside"
    aside.mkdir()
    for index in committed_shards(store):
        (shards_dir(store) / shard_name(index)).rename(aside / shard_name(index))
    waited: list[int] = []

    def commit_next(_seconds: float) -> None:
        waiting = sorted(aside.iterdir())
        waited.append(len(committed_shards(store)))
        if waiting:
            waiting[0].rename(shards_dir(store) / waiting[0].name)

    monkeypatch.setattr(follow.time, "sleep", commit_next)
    return store, waited


def data_cfg(store: Path, **extra: object) -> TrainDataConfig:
    return TrainDataConfig(store=str(store), holdout_sequences=2, follow_poll_s=0.01, **extra)


@pytest.mark.parametrize("world,batch,accum", [(1, 1, 1), (1, 2, 2), (2, 1, 2), (3, 2, 1)])
def test_streamed_epoch_reads_each_committed_sequence_once(growing, world, batch, accum):
    store, waited = growing
    info = open_store(store)
    plans = [FollowPlan(info, data_cfg(store), world, r, batch, accum) for r in range(world)]
    per_rank: list[list[list[tuple[int, int, bool]]]] = []
    for plan in plans:
        batches = []
        for keys in plan.micro_batches(0):
            for index, epoch, _ in keys:  # never a sequence of an uncommitted shard
                assert (shards_dir(store) / shard_name(index // 3)).is_dir() and epoch == 0
            batches.append(keys)
        per_rank.append(batches)
    assert waited[:4] == [0, 1, 2, 3]  # it waited at each shard in turn
    real = sorted(i for batches in per_rank for keys in batches for i, _, pad in keys if not pad)
    assert real == list(range(11))  # 13 sequences, the last 2 held out: each exactly once
    # the same layout as a shuffled epoch's (identity order), hence the same step count per rank
    shuffled = EpochPlan(11, world, 0, batch, accum, 0)
    assert all(len(b) == shuffled.steps_per_epoch * accum for b in per_rank)
    assert plans[0].epoch_done(0, shuffled.steps_per_epoch)
    assert not plans[0].epoch_done(0, shuffled.steps_per_epoch - 1)
    assert plans[0].streamed(shuffled.steps_per_epoch) == 11
    # resuming at any step gives the rest of the same stream
    for start in range(shuffled.steps_per_epoch):
        again = [list(p.micro_batches(0, start)) for p in plans]
        assert again == [b[start * accum :] for b in per_rank]
    # later epochs are the shuffles of the complete store
    for rank, plan in enumerate(plans):
        want = EpochPlan(11, world, rank, batch, accum, 0).micro_batches(1)
        assert list(plan.micro_batches(1)) == list(want)


def test_one_loader_iterator_streams_then_shuffles(growing):
    """The run's one loader iterator (PlanSampler with `steps`) streams epoch 0 as its shards
    commit and goes on into the shuffled epochs, as the per-epoch iterators did."""
    store, waited = growing
    plan = FollowPlan(open_store(store), data_cfg(store), 1, 0, 2, 1)
    sampler = PlanSampler(plan)
    sampler.set_position(0, 0, steps=plan.steps_per_epoch * 2)  # 7 x 2: the schedule's bound
    got = []
    for keys in sampler:
        for index, epoch, pad in keys:  # never a sequence of an uncommitted shard
            assert epoch > 0 or pad or (shards_dir(store) / shard_name(index // 3)).is_dir()
        got.append(keys)
    assert waited[:4] == [0, 1, 2, 3]
    shuffled = EpochPlan(11, 1, 0, 2, 1, 0)  # 6 steps an epoch: two more steps of epoch 2
    want = [*plan.micro_batches(0), *shuffled.micro_batches(1), *shuffled.micro_batches(2)]
    assert got == want[:14] and [k[0][1] for k in got] == [0] * 6 + [1] * 6 + [2] * 2


def test_streamed_epoch_waits_for_the_last_shard_to_place_the_held_out_split(growing):
    store, waited = growing
    plan = FollowPlan(open_store(store), data_cfg(store), 1, 0, 4, 1)
    assert plan.steps_per_epoch == 4  # schedule bound: 5 x 3 - 2 = 13 sequences
    assert plan.known_split() is None
    batches = list(plan.micro_batches(0))
    assert plan.known_split().num_train == 11 and len(batches) == 3  # 11 real, 1 padding
    assert [pad for _, _, pad in batches[-1]] == [False, False, False, True]


def test_epoch_zero_order_is_kept_on_resume(growing):
    store, _ = growing
    plan = FollowPlan(open_store(store), data_cfg(store), 1, 0, 1, 1)
    shuffled = EpochPlan(11, 1, 0, 1, 1, 0)
    with pytest.raises(ValueError, match="was shuffled and is not finished: resume it without"):
        check_stream_position(TrainState(5, 0, 5), plan)
    with pytest.raises(ValueError, match="was streamed and is not finished: resume it with"):
        check_stream_position(TrainState(5, 0, 5, stream=True, streamed_sequences=5), shuffled)
    fresh = TrainState(0, 0, 0)
    check_stream_position(fresh, plan)
    assert fresh.stream


def test_dead_extraction_is_an_error_while_a_held_lock_keeps_it_waiting(tmp_path, monkeypatch):
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=6, sequences_per_shard=3))
    last = shards_dir(store) / shard_name(1)
    shutil.move(last, tmp_path / "aside")
    watch = ExtractionWatch(store, poll_s=0.001, timeout_s=0.01)
    ready = last.is_dir
    with pytest.raises(StoreError, match="extraction seems to have stopped.*waiting for shard 1"):
        watch.wait(ready, "shard 1")
    # the writer lock held (as by a live `dflash extract`): past the timeout it keeps waiting
    fd = os.open(store / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    polls = []

    def poll(seconds: float) -> None:
        REAL_SLEEP(seconds)
        polls.append(seconds)
        if len(polls) == 30:  # well past the timeout: the shard is committed at last
            shutil.move(tmp_path / "aside", last)

    monkeypatch.setattr(follow.time, "sleep", poll)
    try:
        assert follow.writer_lock_held(store)
        watch.wait(ready, "shard 1")
        assert len(polls) == 30
    finally:
        os.close(fd)
    assert not follow.writer_lock_held(store)


# `dflash extract` whose shards from `first_gated` on wait for the file `gate` (no timing)
GATED_EXTRACT = """
import sys, time
from pathlib import Path
import stage1_extract.run as run
gate, first_gated = Path(sys.argv[1]), int(sys.argv[2])
fill = run.fill_shard
def gated(job, target, index, *args):
    while index >= first_gated and not gate.exists():
        time.sleep(0.05)
    return fill(job, target, index, *args)
run.fill_shard = gated
from dflash_offline.cli import main
sys.argv = ["dflash", *sys.argv[3:]]
main()
"""


def _wait_until(check, what: str, procs: list[subprocess.Popen]) -> None:
    """Poll `check` (a safety deadline only: these are never timing assertions)."""
    deadline = time.monotonic() + 300
    while not check():
        for proc in procs:
            assert proc.poll() is None, f"exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} after 300 s"
        REAL_SLEEP(0.1)


def _train(store: Path, out: Path, log: Path) -> subprocess.Popen:
    sets = [
        "optim.epochs=2",
        "run.checkpoint_every=4",
        "run.progress=false",
        "run.log_every=1",
        "data.holdout_sequences=2",
        "data.follow_poll_s=0.1",
        "data.follow_timeout_s=300",
    ]
    command = [sys.executable, "-m", "dflash_offline.cli", "train", "--config", str(DEBUG)]
    command += ["--store", str(store), "--out", str(out), "--follow"]
    command += [arg for item in sets for arg in ("--set", item)]
    return subprocess.Popen(command, cwd=REPO, stderr=log.open("w"), stdout=subprocess.DEVNULL)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_follow_beside_extract_killed_and_resumed(tiny_qwen3, tmp_path):
    """Extract holds shards 3.. at a gate; train --follow trains shards 0-2 (6 sequences, one
    per step), checkpoints at step 4, waits for shard 3 and is killed; a resumed run redoes
    steps 5-6, waits, the gate opens, and it finishes the streamed and a shuffled epoch."""
    store, out, gate = tmp_path / "store", tmp_path / "run", tmp_path / "gate"
    data = write_data(tmp_path)
    sets = [arg for item in (*SMALL, "run.progress=false") for arg in ("--set", item)]
    extract = subprocess.Popen(
        [sys.executable, "-c", GATED_EXTRACT, str(gate), "3", "extract", "--config", str(DEBUG)]
        + ["--model", str(tiny_qwen3), "--data", str(data), "--out", str(store), *sets],
        cwd=REPO,
        stderr=(tmp_path / "extract.log").open("w"),
    )
    first_log, second_log = tmp_path / "train-1.log", tmp_path / "train-2.log"
    train = _train(store, out, first_log)
    try:
        waiting = "waiting for shard 3"
        _wait_until(lambda: waiting in first_log.read_text(), waiting, [extract, train])
        train.send_signal(signal.SIGKILL)
        assert train.wait() == -signal.SIGKILL
        assert not open_store(store).complete and committed_shards(store) == [0, 1, 2]
        first = _metrics(out)
        assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
        train = _train(store, out, second_log)
        resumed = "resumed from"
        _wait_until(lambda: waiting in second_log.read_text(), waiting, [extract, train])
        assert resumed in second_log.read_text() and "step 4" in second_log.read_text()
        gate.touch()
        assert extract.wait(timeout=300) == 0
        assert train.wait(timeout=300) == 0, second_log.read_text()[-3000:]
    finally:
        for proc in (extract, train):
            if proc.poll() is None:
                proc.kill()
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[:6] == [{**r, **_timing(a)} for r, a in zip(first, rows[:6], strict=True)]
    num_train = open_store(store).attrs["counts"]["sequences"] - 2
    streamed = [i for r in rows if r["epoch"] == 0 for i in r["seqs"][0] if i >= 0]
    assert streamed == list(range(num_train))  # in store order, each exactly once
    shuffled = [i for r in rows if r["epoch"] == 1 for i in r["seqs"][0] if i >= 0]
    assert sorted(shuffled) == list(range(num_train)) and shuffled != streamed
    meta = json.loads((out / f"step-{len(rows):06d}" / "meta.json").read_text())
    assert meta["train_state"]["stream"] and meta["train_state"]["streamed_sequences"] == num_train
    assert (out / "export" / "model.safetensors").is_file()


def _timing(row: dict) -> dict:
    """The wall-clock fields of a metrics row (they differ between the two runs)."""
    return {
        k: row[k] for k in ("compute_s", "queue_s", "step_s", "tokens_per_s", "mem_gb") if k in row
    }


def store_being_extracted(tmp_path: Path) -> tuple[Path, Path, str]:
    """A store of 13 sequences in 5 shards as a running extraction leaves it: the root not yet
    complete, shards 3 and 4 not committed (moved to the returned folder). Also returns the
    complete root's zarr.json text, which the extraction's end would write."""
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=13, sequences_per_shard=3))
    meta = store / "zarr.json"
    whole = meta.read_text()
    doc = json.loads(whole)
    doc["attributes"]["dflash"]["complete"] = False
    del doc["attributes"]["dflash"]["counts"]
    meta.write_text(json.dumps(doc))
    aside = tmp_path / "aside"
    aside.mkdir()
    for index in (3, 4):
        (shards_dir(store) / shard_name(index)).rename(aside / shard_name(index))
    return store, aside, whole


def test_two_gloo_processes_share_the_streamed_epoch(tmp_path):
    """Two ranks on a store still being extracted (root incomplete, its last shards committed
    once the run has checkpointed step 2): together they read every sequence once, and the
    held-out evaluation (collective) runs on both once its shards are there."""
    store, aside, _ = store_being_extracted(tmp_path)
    out = tmp_path / "run"

    def commit_later() -> None:
        deadline = time.monotonic() + 300  # a safety net only
        while not (out / "step-000002").is_dir() and time.monotonic() < deadline:
            REAL_SLEEP(0.05)
        for index in (3, 4):
            (aside / shard_name(index)).rename(shards_dir(store) / shard_name(index))

    committer = threading.Thread(target=commit_later)
    committer.start()
    sets = ["optim.epochs=1", "run.progress=false", "data.holdout_sequences=2"]
    sets += ["data.follow_poll_s=0.05", "run.eval_every=2", "run.checkpoint_every=1"]
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", "cpu,cpu", "--follow", *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(cli, args)
    committer.join()
    assert result.exit_code == 0, result.output
    rows = _metrics(out)
    streamed = [r["seqs"] for r in rows if r["epoch"] == 0]
    rank0 = [i for step in streamed for i in step[0]]
    rank1 = [i for step in streamed for i in step[1]]
    assert rank0 == [0, 2, 4, 6, 8, 10] and rank1 == [1, 3, 5, 7, 9, -1]  # -1: padding
    assert "eval_tau" in rows[-1]


def test_a_store_never_created_is_named_as_such(tmp_path: Path) -> None:
    """No `dflash extract` ever started: the error says so, not that extraction stopped."""
    watch = ExtractionWatch(tmp_path / "never", poll_s=0.001, timeout_s=0.01)
    with pytest.raises(StoreError, match=r"no `dflash extract` has created it.*--store path"):
        watch.wait(lambda: False, "the store")


def test_sigterm_while_caught_up_with_extraction_stops_without_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank caught up with an extraction (shards 3-4 not committed yet) gets SIGTERM at its
    first wait: it checkpoints the last step it trained and exits 143 at once; rerun once the
    shards are there, it streams the rest, every training sequence exactly once."""
    store, aside, whole = store_being_extracted(tmp_path)
    meta, out = store / "zarr.json", tmp_path / "run"
    polls: list[float] = []

    def first_poll_signals(seconds: float) -> None:  # only the wait for extraction polls
        polls.append(seconds)
        if len(polls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        REAL_SLEEP(seconds)

    monkeypatch.setattr(follow.time, "sleep", first_poll_signals)
    sets = ["optim.epochs=1", "run.progress=false", "data.holdout_sequences=2"]
    sets += ["data.follow_poll_s=0.05", "data.follow_timeout_s=300", "run.checkpoint_every=100"]
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", "cpu", "--follow", *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert len(polls) == 1  # it did not wait on
    trained = [r["step"] for r in _metrics(out)]
    assert trained == list(range(1, len(trained) + 1)) and trained
    assert f"stopped after step {trained[-1]} of " in result.output
    assert sorted(p.name for p in out.glob("step-*")) == [f"step-{trained[-1]:06d}"]
    monkeypatch.setattr(follow.time, "sleep", REAL_SLEEP)
    for index in (3, 4):  # extraction goes on and completes
        (aside / shard_name(index)).rename(shards_dir(store) / shard_name(index))
    meta.write_text(whole)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    streamed = [i for r in rows if r["epoch"] == 0 for i in r["seqs"][0] if i >= 0]
    assert streamed == list(range(11))  # in store order, each exactly once


def test_a_dead_extraction_keeps_the_steps_trained_before_the_error(tmp_path: Path) -> None:
    """One rank caught up with an extraction that died (shards 3-4 never come, no writer lock):
    past data.follow_timeout_s it stops with the error, and the steps it trained are in a
    checkpoint (run.checkpoint_every is far off), as the error's rerun advice promises."""
    store, _, _ = store_being_extracted(tmp_path)
    out = tmp_path / "run"
    sets = ["optim.epochs=1", "run.progress=false", "data.holdout_sequences=2"]
    sets += ["data.follow_poll_s=0.01", "data.follow_timeout_s=0.05", "run.checkpoint_every=100"]
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", "cpu", "--follow", *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "extraction seems to have stopped" in result.output
    trained = [r["step"] for r in _metrics(out)]
    assert trained == list(range(1, len(trained) + 1)) and trained
    assert sorted(p.name for p in out.glob("step-*")) == [f"step-{trained[-1]:06d}"]


def test_the_time_fit_measures_afresh_once_the_streamed_epoch_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step rate of the streamed epoch (extract sharing the GPU, its shards awaited) is
    dropped when it ends: the time fit restarts its measure there, once, at that step."""
    from stage2_train.time_fit import TimeFit

    store = build_store(tmp_path / "store", FactorySpec(num_sequences=13, sequences_per_shard=3))
    restarts: list[int] = []
    original = TimeFit.restart_measuring
    monkeypatch.setattr(
        TimeFit, "restart_measuring", lambda fit, step: restarts.append(step) or original(fit, step)
    )
    out = tmp_path / "run"
    sets = ["optim.epochs=2", "run.progress=false", "data.holdout_sequences=2"]
    sets += ["data.follow_poll_s=0.01", "run.time_limit_s=600"]
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", "cpu", "--follow", *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = _metrics(out)
    first_of_epoch_1 = next(r["step"] for r in rows if r["epoch"] == 1)
    assert restarts == [first_of_epoch_1 - 1], (restarts, first_of_epoch_1)


def test_the_wait_for_the_store_counts_in_the_time_limit() -> None:
    """run.time_limit_s counts the training process's seconds: --follow's wait for the store
    (before the workers' clocks start) comes off it; one the wait used up leaves one second;
    no limit, or a wait under a second, changes nothing."""
    from common.config import build_config
    from stage2_train.config import TrainConfig
    from stage2_train.train import limit_after_wait

    def cfg(limit: str) -> TrainConfig:
        sets = ["run.out=x", "data.store=s", f"run.time_limit_s={limit}"]
        return build_config(TrainConfig, DEBUG, "train", sets)

    assert limit_after_wait(cfg("600"), 45.0).run.time_limit_s == 555.0
    assert limit_after_wait(cfg("600"), 900.0).run.time_limit_s == 1.0
    assert limit_after_wait(cfg("600"), 0.2).run.time_limit_s == 600.0
    assert limit_after_wait(cfg("null"), 45.0).run.time_limit_s is None


@pytest.mark.parametrize("num_sequences", [3, 13])
def test_the_wait_for_the_store_ends_at_shard_zero(tmp_path, monkeypatch, num_sequences):
    """Shard 0 alone committed (a one-shard store, or the first shard of a running extraction):
    the store is ready at once, without waiting for shard 1 (index 0 is no shard)."""
    spec = FactorySpec(num_sequences=num_sequences, sequences_per_shard=3)
    store = build_store(tmp_path / "store", spec)
    for index in committed_shards(store)[1:]:
        shutil.rmtree(shards_dir(store) / shard_name(index))
    assert committed_shards(store) == [0]

    def no_wait(_seconds: float) -> None:
        raise AssertionError("waited for a store whose shard 0 is committed")

    monkeypatch.setattr(follow.time, "sleep", no_wait)
    follow.wait_for_store(data_cfg(store, follow_timeout_s=0.01))


@pytest.mark.parametrize("world,batch,accum", [(2, 1, 1), (2, 2, 1), (3, 1, 2)])
def test_a_streamed_step_waits_for_the_shards_of_every_rank(growing, world, batch, accum):
    """A rank yields a step of the streamed epoch only once the shards of all ranks'
    sequences of that step are committed: before, rank 0 went on into the step's all-reduce
    while rank 1 waited for its shard (an extract shard's time, or data.follow_timeout_s)."""
    store, waited = growing
    cfg = data_cfg(store)
    info = open_store(store)
    for rank in range(world):
        plan = FollowPlan(info, cfg, world, rank, batch, accum)
        per_step = world * batch * accum
        for i, keys in enumerate(plan.micro_batches(0)):
            step = i // accum
            needed = range(step * per_step, min((step + 1) * per_step, 11))  # 11 train sequences
            committed = set(committed_shards(store))
            missing = {pos // 3 for pos in needed} - committed
            assert not missing, f"rank {rank} step {step}: shards {missing} not committed yet"
            assert all(pad or index // 3 in committed for index, _, pad in keys)
    assert waited[:4] == [0, 1, 2, 3]  # it waited, shard after shard
