"""Background shard writing: the bounded pool of shared buffers, the hand-off of filled buffers
to writers once their device-to-host copies are done, and the bookkeeping of commits and errors.

Writers are processes (`run.writer_processes`, each with its own interpreter and Zarr event
loop, so encoding runs in parallel) or threads of this process (`run.writer_processes=0`). The
pool of buffers is bounded (writers + 1), which is the backpressure: when every buffer waits
for the disk, the producer blocks in `acquire`.
"""

from __future__ import annotations

import errno
import os
import queue
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.logging import get_logger
from common.store import StoreError, shards_dir
from stage1_extract.host_buffers import ShardBuffers
from stage1_extract.writer import ShardLayout, ShardTask, no_space_errno
from stage1_extract.writer_pools import LockWatch, ProcessPool, ThreadPool

KILL_ENV = "DFLASH_TEST_KILL_AFTER_COMMITS"  # test hook: SIGKILL self after this many commits


@dataclass
class ShardJob:
    """One filled shard waiting to be written."""

    task: ShardTask
    buffers: ShardBuffers
    ready: torch.cuda.Event | None  # recorded after the last device-to-host copy
    finite: torch.Tensor  # bool, on the host once `ready`


class ShardWriter:
    """Background writers (processes or threads) over a bounded pool of reusable buffers."""

    def __init__(
        self,
        store: Path,
        layout: ShardLayout,
        processes: int,
        threads: int,
        num_todo: int,
        shard_bytes: int,
        make_buffers: Callable[[], ShardBuffers],
        watch: LockWatch | None,  # the store's lock where another process holds it
    ) -> None:
        self.store, self.layout = store, layout
        # no more writers (nor buffers beyond one per writer + 1) than there are shards to write
        processes, threads = min(processes, num_todo), min(threads, num_todo)
        writers = processes or threads
        self.buffers = [make_buffers() for _ in range(writers + 1)]
        self.free: queue.Queue[int] = queue.Queue()
        for slot in range(len(self.buffers)):
            self.free.put(slot)
        self.shards_left, self.shard_bytes = num_todo, shard_bytes
        if threading.current_thread() is threading.main_thread():
            # past `ulimit -f`, SIGXFSZ would kill the run without a word; ignored, a write
            # raises EFBIG instead, which is reported with the fix (writer processes do the same)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.kill_after = int(os.environ.get(KILL_ENV, "0"))
        self.commits = 0
        self.waited_s = 0.0  # producer time blocked on busy writers: > 0 means IO-bound
        self.drain_s = 0.0  # time close() waited for the last shards
        self.started = time.perf_counter()  # the timeline (debug log) counts from here
        self.handed_at: dict[int, float] = {}
        self.write_s = 0.0  # writer time summed over shards (write, verify, commit)
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()  # the counters and errors are updated from other threads
        # jobs wait here for their copies before going to a writer, in submission order
        self.pending: queue.Queue[ShardJob | None] = queue.Queue()
        self.dispatcher = threading.Thread(target=self._dispatch, name="shard-dispatch")
        self.pool: ProcessPool | ThreadPool = (
            ProcessPool(store, layout, processes, self.buffers, self._done, watch)
            if processes
            else ThreadPool(store, layout, threads, self.buffers, self._done, watch)
        )
        self.dispatcher.start()

    def acquire(self) -> ShardBuffers:
        """A free buffer set; blocks while every set waits for the disk (backpressure)."""
        start = time.perf_counter()
        try:
            while True:
                self.raise_errors()
                try:
                    return self.buffers[self.free.get(timeout=1.0)]
                except queue.Empty:
                    continue
        finally:
            waited = time.perf_counter() - start
            self.waited_s += waited
            if waited > 0.01:
                get_logger().debug(
                    "t=%.2f s: waited %.2f s for a free buffer", self.clock(), waited
                )

    def clock(self) -> float:
        """Seconds since the writers were created: the debug timeline's time."""
        return time.perf_counter() - self.started

    @property
    def ready_after_s(self) -> float | None:
        """When the last writer became ready (None: not all yet)."""
        return self.pool.ready_after_s

    def submit(self, job: ShardJob) -> None:
        self.pending.put(job)

    def _dispatch(self) -> None:
        while (job := self.pending.get()) is not None:
            slot = next(i for i, b in enumerate(self.buffers) if b is job.buffers)
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                job.task.finite = bool(job.finite)
            except BaseException as err:  # a CUDA error surfaces here: report, free the slot
                self._done(slot, job.task.index, err, 0.0)
                continue
            self.handed_at[job.task.index] = self.clock()
            self.pool.submit(slot, job.task)

    def _done(self, slot: int, index: int, error: BaseException | None, seconds: float) -> None:
        """Called by the pool when shard `index` in buffer `slot` is committed or failed."""
        if error is not None and (code := no_space_errno(error)) is not None:
            error = self._no_space(index, code)
        with self.lock:
            if error is not None:
                self.errors.append(error)
            else:
                self.shards_left -= 1
                self.commits += 1
                self.write_s += seconds
            kill = error is None and self.kill_after and self.commits >= self.kill_after
        get_logger().debug(
            "t=%.2f s: shard %d %s, handed to a writer at t=%.2f s, %.2f s writing",
            self.clock(),
            index,
            "failed" if error else "committed",
            self.handed_at.pop(index, float("nan")),
            seconds,
        )
        self.free.put(slot)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)

    def _no_space(self, index: int, code: int) -> StoreError:
        """The one-line error of a shard write that ran out of room (the shard is not
        committed: its temporary folder is removed, and a rerun writes it again)."""
        folder, shard = shards_dir(self.store), self.shard_bytes / 2**30
        if code == errno.EFBIG:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit / 2**30:.2f} GiB"
            return StoreError(
                f"file-size limit hit while writing shard {index} into {folder}: a shard "
                f"needs up to {shard:.2f} GiB (uncompressed), the limit (`ulimit -f`) is "
                f"{shown}; raise it or lower store.sequences_per_shard, then rerun the same "
                "command to resume; committed shards are kept"
            )
        free = shutil.disk_usage(self.store).free
        need = self.shards_left * self.shard_bytes
        return StoreError(
            f"disk full while writing shard {index} of store {self.store} into {folder}: "
            f"{free / 2**30:.2f} GiB free, a shard needs up to {shard:.2f} GiB and the "
            f"{self.shards_left} shard(s) left up to {need / 2**30:.2f} GiB (uncompressed); "
            "free space (or move --out) and rerun the same command to resume; committed "
            "shards are kept"
        )

    def raise_errors(self) -> None:
        with self.lock:
            if self.errors:
                raise self.errors[0]
        self.pool.check_alive()

    def close(self) -> None:
        """Wait for every submitted shard (committed ones stay committed on errors)."""
        start = time.perf_counter()
        self.pending.put(None)
        self.dispatcher.join()
        try:
            self.pool.close()
        finally:
            for buffers in self.buffers:
                buffers.release()
            self.drain_s = time.perf_counter() - start
        self.raise_errors()
