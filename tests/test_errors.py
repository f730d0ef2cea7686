"""Every user-facing failure of the `dflash` command is one `error:` line with the fix (exit 2),
a bug is one line with the way to its traceback (exit 1), and a worker process's error comes
out as that worker's own line. Disk-full writes (fault-injected) leave the run resumable."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from store_factory import FactorySpec, build_store

from common.store import HEAD_FILE
from dflash_offline.cli import main as cli
from stage2_train import checkpoint, export

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("errors") / "store", FactorySpec(num_sequences=7))


def train(store: Path, out: Path, *sets: str, devices: str = "cpu", flags: tuple = ()):
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    args += ["--devices", devices, "--set", "run.progress=false", *flags]
    for item in ("optim.max_steps=4", "run.checkpoint_every=2", "run.keep_checkpoints=3", *sets):
        args += ["--set", item]
    return CliRunner().invoke(cli, args)


def error_line(result) -> str:
    """The output's `error:` line; there is exactly one, and no traceback."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_out_naming_a_file(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.write_text("")
    result = train(store, out)
    assert result.exit_code == 2
    assert f"--out {out} is a file; pass a folder" in error_line(result)


def test_truncated_head_file(store: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(store, tmp_path / "store"))
    head = copy / HEAD_FILE
    head.write_bytes(head.read_bytes()[: head.stat().st_size // 2])
    result = train(copy, tmp_path / "run")
    assert result.exit_code == 2
    line = error_line(result)
    assert f"{head} is damaged" in line and "rerun the same `dflash extract`" in line


def test_a_bug_is_one_line_with_the_way_to_its_traceback(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(cfg):
        raise KeyError("oops")

    monkeypatch.setattr("stage2_train.train.run_train", broken)
    result = train(store, tmp_path / "run")
    assert result.exit_code == 1
    assert error_line(result) == (
        "error: KeyError: 'oops' (run with DFLASH_LOG_LEVEL=DEBUG for the traceback)"
    )
    monkeypatch.setenv("DFLASH_LOG_LEVEL", "DEBUG")
    result = train(store, tmp_path / "run")
    assert result.exit_code == 1 and "Traceback" in result.output
    assert result.output.rstrip().endswith("error: KeyError: 'oops'")


def test_a_worker_error_is_the_workers_line(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train(store, out, "optim.max_steps=2").exit_code == 0
    # two processes resume a one-process run: refused in the workers, after they started
    result = train(store, out, "optim.max_steps=2", devices="cpu,cpu")
    assert result.exit_code == 2
    assert "world size: 1 -> 2 processes" in error_line(result)
    assert "ChildFailedError" not in result.output and "Connection reset" not in result.output


def test_disk_full_while_checkpointing_then_a_rerun_resumes(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    real_save = torch.save

    def full_at_step_4(obj, path, *args, **kwargs):
        if "step-000004" in str(path) and str(path).endswith("model.pt"):
            real_save(obj, path, *args, **kwargs)  # a part written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_4)
    result = train(store, out)
    assert result.exit_code == 2
    line = error_line(result)
    assert f"no space left writing checkpoint {out / 'step-000004'} (needs about" in line
    assert "resume from step-000002" in line
    assert [p.name for p in out.iterdir() if p.name.startswith(("step-", ".tmp"))] == [
        "step-000002"
    ]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    result = train(store, out)
    assert result.exit_code == 0, result.output
    assert (out / "step-000004" / "model.pt").is_file() and (out / "export").is_dir()


def test_file_size_limit_while_exporting_then_a_rerun_exports(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    assert train(store, out, "optim.max_steps=2").exit_code == 0
    real_save = export.save_file

    def too_big(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(export, "save_file", too_big)
    target = tmp_path / "exported"
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(target)])
    assert result.exit_code == 2
    line = error_line(result)
    assert f"file-size limit hit writing export {target} (needs about" in line
    assert f"rerun `dflash export {out}`" in line
    assert not target.exists() and not (tmp_path / ".tmp-exported").exists()
    monkeypatch.setattr(export, "save_file", real_save)
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(target)])
    assert result.exit_code == 0 and (target / "model.safetensors").is_file()

    # an export replaces its folder whole: a folder that is not an export (the run itself, a
    # folder of other files) is refused and kept; an earlier export is replaced
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    for folder in (out, tmp_path / "models", tmp_path):
        result = CliRunner().invoke(cli, ["export", str(out), "--out", str(folder)])
        assert result.exit_code == 2 and "is not a drafter export" in error_line(result)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (tmp_path / "models" / "notes.txt").read_text() == "mine"
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(target), "--step", "0"])
    assert result.exit_code == 2 and "no checkpoint step 0 to export" in error_line(result)
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(target)])
    assert result.exit_code == 0 and not (tmp_path / ".tmp-old-exported").exists()


def test_a_second_train_into_the_same_run_is_refused(store: Path, tmp_path: Path) -> None:
    """Two `dflash train` into one --out: the second is refused naming the first (it deleted
    the first's checkpoint in the making and interleaved the metrics); once the first has
    ended, the run resumes."""
    from common.locks import exclusive_lock
    from stage2_train.train import RUN_LOCK

    out = tmp_path / "run"
    out.mkdir()
    with exclusive_lock(out / RUN_LOCK, RuntimeError):  # a first run holds it
        result = train(store, out)
    assert result.exit_code == 2
    line = error_line(result)
    assert f"--out {out}: another `dflash train` is writing this run (pid" in line
    assert not list(out.glob("step-*"))
    assert train(store, out).exit_code == 0 and (out / "export").is_dir()


@pytest.mark.parametrize("damage", ["no_shards", "bad_hidden_meta"])
def test_first_shard_gone_or_unreadable(store: Path, tmp_path: Path, damage: str) -> None:
    """The input checks read shard 0's hidden metadata before the file checks: with every shard
    folder gone they died on an IndexError (a 'bug' line), with its zarr.json cut on a bare JSON
    error naming no file (now the report of every damaged shard, as the start-up check gives)."""
    import shutil

    copy = Path(shutil.copytree(store, tmp_path / "store"))
    shards = copy / "shards"
    if damage == "no_shards":
        for folder in shards.iterdir():
            shutil.rmtree(folder)
        expected = f"store {copy} has no committed shard"
    else:
        meta = shards / "shard-000000" / "hidden" / "zarr.json"
        meta.write_text(meta.read_text()[:20])
        # the start-up report of every damaged shard, not a message of its own (test_store_check)
        expected = "\n  - shard-000000 array hidden: file hidden/zarr.json is 20 bytes"
    result = train(copy, tmp_path / "run")
    assert result.exit_code == 2, result.output
    error_line(result)  # one error, no traceback
    assert expected in result.output and "rerun the same `dflash extract`" in result.output


def test_export_of_the_wrong_folder_says_what_to_pass(store: Path, tmp_path: Path) -> None:
    """`dflash export X` where X is not a run folder with a checkpoint: the error names what X
    is and what to pass instead, not only that nothing was found."""
    out = tmp_path / "run"
    assert train(store, out, "optim.max_steps=2", "run.checkpoint_every=1").exit_code == 0
    cases = {
        (tmp_path / "missing",): "no such folder: pass the run folder `dflash train --out` wrote",
        (
            out / "step-000002",
        ): f"this is one checkpoint: pass its run folder, {out}, with --step N",
        (out / "export",): "this is already an export",
        (out, "--step", "7"): "kept steps: 1, 2 (run.keep_checkpoints sets how many stay)",
        (tmp_path,): "pass the run folder `dflash train --out` wrote, after its first checkpoint",
    }
    for args, fix in cases.items():
        result = CliRunner().invoke(cli, ["export", *map(str, args), "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and fix in error_line(result), (args, result.output)


def test_gpu_devices_on_a_machine_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.distributed import parse_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError) as err:
        parse_devices("2,3")  # e.g. train's default run.devices, never typed by the user
    assert "(--devices, or run.devices in the config)" in str(err.value)
    assert "this machine has no CUDA GPU; pass --devices cpu" in str(err.value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"has 2 GPU\(s\), ids 0..1; pass existing ids"):
        parse_devices("2,3")


@pytest.mark.parametrize("devices", ["0,0", "0,cuda:0", "1,0,1"])
def test_a_gpu_listed_twice_is_refused(monkeypatch: pytest.MonkeyPatch, devices: str) -> None:
    """Two processes on one GPU: NCCL fails in its set-up after the output folder exists (or
    they share its memory); refused when the devices are read, naming the GPU."""
    from common.distributed import parse_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="more than once; list each GPU once") as err:
        parse_devices(devices)
    assert "cuda:0" in str(err.value) or "cuda:1" in str(err.value)
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]  # CPU processes: as many as asked


@pytest.mark.parametrize(
    "command, runner, interrupt",
    [
        ("generate", "stage1_generate.run.run_generate", "ctrl-c"),
        ("extract", "stage1_extract.run.run_extract", "launcher"),
        ("train", "stage2_train.train.run_train", "ctrl-c"),
    ],
)
def test_ctrl_c_says_how_to_resume_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, runner: str, interrupt: str
) -> None:
    """Click's own "Aborted!" exited 1, a bug's code, and said nothing of the work kept."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(*_args, **_kwargs):
        if interrupt == "launcher":  # several --devices: torchrun's launcher got the Ctrl-C
            raise SignalException("Process 1 got signal: 2", signal.SIGINT)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, interrupted)
    args = [command, "--config", str(DEBUG), "--out", str(tmp_path / "out")]
    args += ["--store", "S"] if command == "train" else ["--model", "M", "--data", "D"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    assert "Aborted!" not in result.output and "error:" not in result.output
    expected = "rerun the same command to resume"
    assert result.output.strip().splitlines()[-1].startswith("interrupted (Ctrl-C): ")
    assert expected in result.output
