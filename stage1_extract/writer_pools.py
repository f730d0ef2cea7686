"""The two kinds of shard writers behind `ShardWriter`: threads of this process, or processes
that map the same shared buffers.

Threads share one interpreter, and zarr runs every write of a process through one event loop:
on the 2-core build machine (`bench/zarr_write.py --parallel 2`) two writer threads together
wrote slower than one alone, two processes about twice as fast as two threads. Each writer
process maps every buffer arena, takes (buffer slot, task) pairs from one queue and reports
(slot, shard index, error, seconds) on another.

A writer of a killed extraction (even by SIGKILL) must never commit a shard: the kernel releases
the store's writer lock at once, and a rerun may be writing the same shard or have planned it in
its resume scan. So a writer exits as soon as the extracting process has (a watch thread), leaving
a temporary folder that the next run removes; checks again just before the commit's rename (the
watch needs this process's GIL and a core, so it can be late), and gives up there, removing its
temporary folder; and holds a copy of the lock's descriptor (an flock belongs to the open file,
common/locks.py), so the lock stays held, and a rerun refused, until the last writer has exited.
Only the process that took the lock has that descriptor: the writers of the others (the GPU
processes of a local launch, torchrun's ranks but 0) commit only while the process that took it
for their run still holds it (`LockWatch`, of the holder text it handed down), so that once it
is gone no shard of theirs lands in a store that a rerun may be scanning or cleaning: a killed
launcher's GPU processes get SIGINT twice (the first drains the writers, the second stops them),
torchrun stops the other ranks of a killed rank 0 at its next poll, and ranks on other hosts
extract on until a collective fails.

Writers are forked from a forkserver that imported this module once: a spawned writer would
import torch, zarr and the caller's whole main module (a bench or a user script that imports
transformers) before its first write, eight at a time. The forkserver never touches CUDA, so
forking from it is safe; it exits once the extracting process and the writers have.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from common.locks import held_lock_fd, lock_holder
from stage1_extract.host_buffers import BufferShape, HostArena, ShardBuffers
from stage1_extract.store_root import LOCK_FILE
from stage1_extract.writer import ShardLayout, ShardTask, no_space_errno, write_shard

# (slot, shard index, error or None, seconds spent writing)
READY = -1  # the slot of the message a writer process sends once it is ready to write
# how often the collector looks whether an interrupted close() left it nothing to wait for
COLLECT_POLL_S = 0.5
Done = Callable[[int, int, BaseException | None, float], None]


class ThreadPool:
    def __init__(
        self,
        store: Path,
        layout: ShardLayout,
        threads: int,
        buffers: list[ShardBuffers],
        done: Done,
        watch: LockWatch | None,
    ) -> None:
        self.store, self.layout, self.buffers, self.done = store, layout, buffers, done
        self.watch = watch
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard-writer")
        self.ready_after_s: float | None = 0.0
        self.stopped = False  # set by stop(): no shard commits from then on
        self.renaming = threading.Lock()  # held by a writer from its check to its rename's end

    def submit(self, slot: int, task: ShardTask) -> None:
        self.executor.submit(self._write, slot, task)

    def _write(self, slot: int, task: ShardTask) -> None:
        error, start, renaming = None, time.perf_counter(), False

        def before_commit() -> None:
            nonlocal renaming
            if self.watch is not None:
                self.watch.check()
            self.renaming.acquire()
            if self.stopped:
                self.renaming.release()
                raise RuntimeError(f"shard {task.index} not committed: the writers were stopped")
            renaming = True

        try:
            write_shard(self.store, task, self.buffers[slot], self.layout, before_commit)
        except BaseException as err:
            error = err
        finally:
            if renaming:
                self.renaming.release()
        self.done(slot, task.index, error, time.perf_counter() - start)

    def check_alive(self) -> None:
        return

    def stop(self) -> None:
        """No shard commits once this returns (a rename under way has ended): called before the
        store's lock is released while writers may still run (a second Ctrl-C). Threads, unlike
        writer processes, hold no lock of their own: a rerun could take it and scan the store
        while one renames its shard into place. A shard being written is dropped at its commit;
        those not started are not written."""
        with self.renaming:
            self.stopped = True
        self.executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class ProcessPool:
    def __init__(
        self,
        store: Path,
        layout: ShardLayout,
        processes: int,
        buffers: list[ShardBuffers],
        done: Done,
        watch: LockWatch | None,
    ) -> None:
        # never fork a process that holds CUDA state: fork from a clean server instead
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        self.tasks: mp.Queue = ctx.Queue()
        self.results: mp.Queue = ctx.Queue()
        self.done = done
        self.started_at = time.perf_counter()
        self.ready_after_s: float | None = None  # set by the collector once all are ready
        self.not_ready = processes
        arenas = [b.arena for b in buffers]
        lock = held_lock_fd(store / LOCK_FILE)  # None where another process holds it
        shared_lock = None if lock is None else SharedFd(lock)
        args = (store, layout, buffers[0].shape, arenas, self.tasks, self.results)
        args += (os.getpid(), shared_lock, watch)
        self.procs = [
            ctx.Process(target=_writer_main, args=args, name=f"shard-writer-{i}", daemon=True)
            for i in range(processes)
        ]
        for proc in self.procs:
            proc.start()
        self.closing = False
        # a daemon: a process whose close() was interrupted must still exit, not wait for it
        self.collector = threading.Thread(target=self._collect, name="shard-collect", daemon=True)
        self.collector.start()

    def submit(self, slot: int, task: ShardTask) -> None:
        self.tasks.put((slot, task))

    def _collect(self) -> None:
        while True:
            try:
                item = self.results.get(timeout=COLLECT_POLL_S)
            except queue.Empty:  # an interrupted close() terminated the writers: no None comes
                if self.closing and not any(p.is_alive() for p in self.procs):
                    return
                continue
            if item is None:  # close(): after the last message of every writer, all exited
                return
            slot, index, error, seconds = item
            if slot == READY:
                self.not_ready -= 1
                if not self.not_ready:
                    self.ready_after_s = time.perf_counter() - self.started_at
                continue
            self.done(slot, index, error, seconds)

    def check_alive(self) -> None:
        dead = [p for p in self.procs if p.exitcode not in (None, 0)]
        if dead:
            codes = ", ".join(f"{p.name}: {p.exitcode}" for p in dead)
            raise RuntimeError(
                f"shard writer process(es) died ({codes}; a negative code is the signal, -9 is "
                "often the out-of-memory killer); rerun the same command to resume, with fewer "
                "run.writer_processes if memory is short"
            )

    def stop(self) -> None:
        """Nothing to do: the writers hold copies of the store's lock (or watch its holder), so
        no rerun starts while one of them could commit."""

    def close(self) -> None:
        """Let the writers commit the shards they hold, then stop them. Interrupted (a second
        Ctrl-C; a killed launcher's GPU processes get SIGINT twice, 40 ms apart), stop them at
        once: their shards stay uncommitted, and the next run removes the temporary folders."""
        try:
            for _ in self.procs:
                self.tasks.put(None)
            for proc in self.procs:
                proc.join()
        except BaseException:
            for proc in self.procs:
                proc.terminate()
            raise
        finally:
            self.closing = True  # the collector returns once every writer has exited
        # the collector's end, behind every writer's messages (each flushed its queue as it
        # exited); it waited for its next poll instead, up to 0.5 s per close
        self.results.put(None)
        self.collector.join()
        self.tasks.close()
        self.results.close()


class SharedFd:
    """A descriptor of this process that a writer process receives a copy of, as it starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # DupFd hands the descriptor to the child (only while it is being started)
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup_fd: Any) -> int:
    return dup_fd.detach()


class ExtractionEnded(Exception):
    """The extracting process has exited: this writer must not commit its shard."""


@dataclass(frozen=True)
class LockWatch:
    """The store's lock where another process holds it: the writers of this process commit
    only while the process that took it for their run still holds it (and rank 0 its head
    file, stage1_extract/run.py)."""

    path: Path
    holder: str  # what the process that took the lock for this run wrote into the lock file

    @staticmethod
    def of(store: Path, holder: str) -> LockWatch | None:
        """The watch of `holder`, handed down from where the lock was taken (the launcher, or
        rank 0), never read from the file here: a process that starts its writers minutes after
        the launcher was killed could find a rerun's text there. None where this process holds
        the lock itself."""
        path = store / LOCK_FILE
        return None if held_lock_fd(path) is not None else LockWatch(path, holder)

    def check(self) -> None:
        """Raise once the holder is gone, even where a new run holds the lock now."""
        if lock_holder(self.path) != self.holder:
            raise RuntimeError(
                f"the process that held the writer lock of store {self.path.parent} "
                f"({self.holder}) is gone; this process commits nothing more to it"
            )


def _extraction_exits(extracting_pid: int) -> list[int]:
    """Descriptors that turn readable once the extracting process has exited: the pipe that
    multiprocessing keeps from it (its end closes with its other files, the lock's among them,
    unless a process it forked holds a copy) and its pidfd (Linux 5.3+; exited once a zombie,
    where `kill(pid, 0)` still finds it). Not getppid or PR_SET_PDEATHSIG: this writer's
    parent is the forkserver, which lives as long as any of its children do."""
    parent = mp.parent_process()
    assert parent is not None
    fds = [parent.sentinel]
    try:
        fds.append(os.pidfd_open(extracting_pid))
    except ProcessLookupError:  # already gone
        os._exit(1)
    except (OSError, AttributeError):
        pass
    return fds


def _die_with_extraction(exits: list[int]) -> None:
    """Exit the moment the extracting process ends, however it ends."""

    def watch() -> None:
        wait(exits)
        os._exit(1)  # from any thread: ends the whole process, mid-write or not

    threading.Thread(target=watch, name="watch-extraction", daemon=True).start()


def _portable(err: BaseException) -> BaseException:
    """`err` as it can cross to the parent: a disk-full or file-size error stays recognisable."""
    if (code := no_space_errno(err)) is not None:
        return OSError(code, str(err))
    try:
        pickle.dumps(err)
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _writer_main(
    store: Path,
    layout: ShardLayout,
    shape: BufferShape,
    arenas: list[HostArena],
    tasks: mp.Queue,
    results: mp.Queue,
    extracting_pid: int,
    lock: int | None,  # a copy of the store lock's descriptor, kept open, never used
    watch: LockWatch | None,  # the lock where another process holds it
) -> None:
    exits = _extraction_exits(extracting_pid)
    _die_with_extraction(exits)

    def before_commit() -> None:  # the watch may not have run yet
        if wait(exits, timeout=0):
            raise ExtractionEnded
        if watch is not None:
            watch.check()

    # Ctrl-C reaches the whole process group: the parent stops producing and closes the pool,
    # which lets the writers finish and commit the shards they hold, as writer threads would
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # past `ulimit -f`, SIGXFSZ would kill this writer silently: ignored, the write raises EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # the extracting process feeds the GPU and must not wait for a core; writers have slack
    os.nice(10)
    buffers = [ShardBuffers(shape, arena) for arena in arenas]
    results.put((READY, -1, None, 0.0))
    while (item := tasks.get()) is not None:
        slot, task = item
        error, start = None, time.perf_counter()
        try:
            write_shard(store, task, buffers[slot], layout, before_commit)
        except ExtractionEnded:  # its temporary folder is removed; no one reads the results
            os._exit(1)
        except Exception as err:
            traceback.print_exc()  # the parent re-raises the error; the trace stays here
            error = _portable(err)
        results.put((slot, task.index, error, time.perf_counter() - start))
