"""A `dflash extract` killed with SIGKILL while a writer process holds a shard: that writer
never commits it, and no other extraction can take the store's lock while it lives.

The extraction is a child process that takes the store's writer lock and starts the real
ShardWriter (one writer process, as extract does); its writer stops just before the commit
until the test says go. The test kills the child, then checks the lock and the shards. Three
ways a writer learns that its extraction is gone: the normal one; no pidfd (Linux < 5.3 or a
seccomp filter; the killed process stays an unreaped zombie meanwhile, as it does until its
parent waits for it); and a watch that has not fired yet (a busy host), where only the check
before the rename and the shared lock stand between the orphan and the store.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.store import TMP_PREFIX, committed_shards, shards_dir
from stage1_extract import writer, writer_pools
from stage1_extract.host_buffers import BufferShape, ShardBuffers
from stage1_extract.shard_writer import ShardJob, ShardWriter
from stage1_extract.store_root import LOCK_FILE, writer_lock
from stage1_extract.writer import ShardLayout, ShardTask

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="flock, /proc and memfd")

SHAPE = BufferShape(slots=8, num_tapped=2, hidden_size=4, topk=2, vocab=None, fp8=False)
CONTROL_ENV = "DFLASH_TEST_ORPHAN_CONTROL"  # folder of the `reached` and `go` files
VARIANT_ENV = "DFLASH_TEST_ORPHAN_VARIANT"


def _held_writer_main(*args: object) -> None:
    """The writer process: the real `_writer_main`, its commit held until the test says go."""
    control, variant = Path(os.environ[CONTROL_ENV]), os.environ[VARIANT_ENV]
    if variant == "no pidfd":

        def no_pidfd(_pid: int, _flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "pidfd_open")

        os.pidfd_open = no_pidfd
    elif variant == "late watch":
        writer_pools._die_with_extraction = lambda *_args: None
    real_commit = writer.commit_folder

    def held_commit(*commit_args: object, **kwargs: object) -> None:
        (control / "reached").write_text(str(os.getpid()))
        while not (control / "go").exists():
            time.sleep(0.01)
        real_commit(*commit_args, **kwargs)

    writer.commit_folder = held_commit
    writer_pools._writer_main(*args)


def _extraction(store: Path) -> None:
    """The killed `dflash extract`: lock, writers, one shard handed over, then waits."""
    writer_pools._writer_main = _held_writer_main  # the target the writer processes run
    with writer_lock(store):
        shards_dir(store).mkdir()
        shard = ShardWriter(
            store,
            ShardLayout(8, 8, 1),
            processes=1,
            threads=0,
            num_todo=1,
            shard_bytes=1 << 20,
            make_buffers=lambda: ShardBuffers.allocate(SHAPE, pin=False),
        )
        buffers = shard.acquire()
        host = buffers.tensors
        host["tokens"][:] = torch.arange(8, dtype=torch.int32)
        host["document_ids"][:] = 0
        host["loss_mask"][:] = 1
        host["hidden"].view(-1)[:] = 1.5
        documents = {"doc_length": np.array([8], np.int32)}
        attrs = {"num_tokens": 8, "num_loss_tokens": 8, "num_documents": 1}
        task = ShardTask(index=0, num_sequences=1, documents=documents, attrs=attrs)
        shard.submit(ShardJob(task, buffers, None, torch.tensor(True)))
        time.sleep(600)


def _running(pid: int) -> bool:
    """Whether a thread of process `pid` runs: the last one out closes its files (and so
    releases its locks) before it turns zombie, which a first one out may already be."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # that thread is gone
            continue
        if state not in ("Z", "X"):
            return True
    return False


def _lock_is_free(store: Path) -> bool:
    """What a new `dflash extract` finds: can it take the store's writer lock?"""
    fd = os.open(store / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _wait(condition: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(condition())  # type: ignore[operator]


@pytest.mark.parametrize("variant", ["pidfd", "no pidfd", "late watch"])
def test_a_killed_extractions_writer_never_commits(tmp_path: Path, variant: str) -> None:
    store, control = tmp_path / "store", tmp_path / "control"
    store.mkdir()
    control.mkdir()
    env = {**os.environ, CONTROL_ENV: str(control), VARIANT_ENV: variant}
    script = "import sys; from pathlib import Path; from tests.test_review_orphan_writers "
    script += "import _extraction; _extraction(Path(sys.argv[1]))"
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", script, str(store)], cwd=root, env=env)
    writer_pid = None
    try:
        assert _wait(lambda: (control / "reached").exists() or child.poll() is not None, 180)
        assert child.poll() is None, "the extraction ended before its writer held the shard"
        writer_pid = int((control / "reached").read_text())
        os.kill(child.pid, signal.SIGKILL)
        # dead but not reaped (a zombie, as until its parent waits): its lock fd is closed
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        if variant == "late watch":
            assert _running(writer_pid)
        # a new extraction may start only once the killed one's writers are gone
        if _lock_is_free(store):
            assert not _running(writer_pid), "lock free while the killed run's writer runs"
        (control / "go").touch()
        gone = _wait(lambda: not _running(writer_pid), 10)
        assert committed_shards(store) == [], "the orphaned writer committed its shard"
        assert gone, "the orphaned writer lives on"
        assert _lock_is_free(store)
        if variant == "late watch":  # it gave up at the commit: its temporary folder is gone
            assert not list(shards_dir(store).glob(f"{TMP_PREFIX}*"))
    finally:
        (control / "go").touch()
        if child.poll() is None:
            child.kill()
        child.wait()
        if writer_pid is not None and _running(writer_pid):
            os.kill(writer_pid, signal.SIGKILL)
