"""Stopping `dflash train` early: SIGTERM (sent to the whole process group, as `timeout` and
schedulers do), a first Ctrl-C or `run.time_limit_s` finish the step in flight, checkpoint it
and exit with the reason's code; the rerun resumes with nothing lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from store_factory import FactorySpec, build_store

from dflash_offline.cli import main as cli
from stage2_train.stop import StopRequests

REPO = Path(__file__).parents[1]
DEBUG = REPO / "configs" / "debug.yaml"
BASE = ["run.progress=false", "optim.max_steps=6", "run.checkpoint_every=1000"]

# `dflash train` with every step slowed to 0.2 s, so a signal surely lands mid-run
SLOW_TRAIN = """
import sys, time
import stage2_train.trainstep as trainstep
queue = trainstep.StepRunner.queue
def slow(self, *args, **kwargs):
    time.sleep(0.2)
    return queue(self, *args, **kwargs)
trainstep.StepRunner.queue = slow
from dflash_offline.cli import main
sys.argv = ["dflash", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("stop") / "store", FactorySpec(num_sequences=9))


def args(store: Path, out: Path, sets: list[str], devices: str = "cpu") -> list[str]:
    out_args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    return [*out_args, "--devices", devices, *[a for s in sets for a in ("--set", s)]]


def train(store: Path, out: Path, *sets: str, devices: str = "cpu"):
    return CliRunner().invoke(cli, args(store, out, [*BASE, *sets], devices))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("step-"))


def stopped_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and "error:" not in output and "Traceback" not in output, output
    return lines[0]


def test_time_limit_stops_after_a_step_with_its_checkpoint_then_resumes(
    store: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "whole"
    assert train(store, reference).exit_code == 0
    out = tmp_path / "run"
    result = train(store, out, "run.time_limit_s=0.001")
    assert result.exit_code == 124, result.output
    assert stopped_line(result.output) == (
        f"stopped: run.time_limit_s reached: stopped after step 1 of 6 with a checkpoint in "
        f"{out / 'step-000001'}; rerun the same command to resume from it"
    )
    assert checkpoints(out) == ["step-000001"] and not (out / "export").exists()
    assert [r["step"] for r in metrics(out)] == [1]
    result = train(store, out)
    assert result.exit_code == 0, result.output
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in metrics(reference)])
    assert (out / "export" / "model.safetensors").is_file()


def test_two_ranks_stop_after_the_same_step(store: Path, tmp_path: Path) -> None:
    """Read at once, two ranks stop after the step the limit passed in, together; read late
    (the default), the ranks' stop agreement after a step is read after the next one was
    queued: they stop a step later, together. One run folder (each launch of two gloo
    processes costs seconds of start-up): read at once from the start (after step 1), then
    resumed read late (after its second step, 3), then resumed to the end."""
    out = tmp_path / "run"
    start = 0
    for late in (False, True):
        sets = ["run.time_limit_s=0.001", f"run.read_metrics_late={str(late).lower()}"]
        result = train(store, out, *sets, devices="cpu,cpu")
        assert result.exit_code == 124, (late, result.output)
        stop_step = start + (2 if late else 1)
        assert f"stopped after step {stop_step} of " in stopped_line(result.output), late
        assert [r["step"] for r in metrics(out)] == list(range(1, stop_step + 1))
        meta = json.loads((out / f"step-{stop_step:06d}" / "meta.json").read_text())
        prints = meta["replica_fingerprints"]  # (two figures per rank): one set of weights
        assert len(prints) == 4 and prints[:2] == prints[2:], late
        start = stop_step
    result = train(store, out, devices="cpu,cpu")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in metrics(out)] == list(range(1, len(metrics(out)) + 1))


def test_sigterm_to_the_process_group_checkpoints_the_last_step(
    store: Path, tmp_path: Path
) -> None:
    """As `timeout` sends it: to the trainer and its loader workers alike."""
    out, log = tmp_path / "run", tmp_path / "train.log"
    sets = [*BASE, "optim.max_steps=60", "optim.epochs=100", "run.log_every=1"]
    sets += ["data.num_workers=2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_TRAIN, *args(store, out, sets)],
        cwd=REPO,
        stderr=log.open("w"),
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, signalled whole
    )
    try:
        deadline = time.monotonic() + 300  # a safety net, not a timing assertion
        while not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step after 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = metrics(out)[-1]["step"]
    assert 2 <= last < 60
    assert f"stopped: SIGTERM received: stopped after step {last} of 60" in log.read_text()
    assert checkpoints(out) == [f"step-{last:06d}"]  # the stop's own checkpoint
    # the rerun, as a user runs it (a process of its own: forking loader workers from this
    # one, after the launcher's threads of the other tests, is not safe)
    rerun = [sys.executable, "-m", "dflash_offline.cli", *args(store, out, sets)]
    done = subprocess.run(rerun, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == list(range(1, 61))


def test_a_second_ctrl_c_stops_at_once() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopRequests(None, torch.device("cpu"), 1) as stop:
        assert stop.due() == 0
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.due() == 128 + signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here at the latest
    assert signal.getsignal(signal.SIGINT) is before


def test_a_time_limit_must_be_positive(store: Path, tmp_path: Path) -> None:
    result = train(store, tmp_path / "run", "run.time_limit_s=0")
    assert result.exit_code == 2
    assert "time_limit_s must be > 0" in result.output
