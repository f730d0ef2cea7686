"""The writer pools on their own: a writer's error comes back to the parent with its message
(a full disk stays recognisable), a writer that dies is reported, not waited for, an
interrupted close leaves a writer thread still encoding its shard the buffers it reads, and a
close returns once the writers have, not at the collector's next poll."""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from stage1_extract.host_buffers import BufferShape, ShardBuffers
from stage1_extract.writer import ShardLayout, ShardTask, is_disk_full
from stage1_extract.writer_pools import ProcessPool, _portable

SHAPE = BufferShape(
    slots=8, num_tapped=2, hidden_size=4, topk=2, vocab=None, hidden_dtype="bfloat16"
)


class Results:
    def __init__(self) -> None:
        self.got: list[tuple[int, int, BaseException | None]] = []
        self.event = threading.Event()

    def __call__(self, slot: int, index: int, error: BaseException | None, _s: float) -> None:
        self.got.append((slot, index, error))
        self.event.set()


def test_a_writer_error_comes_back_with_its_message(tmp_path: Path) -> None:
    buffers = [ShardBuffers.allocate(SHAPE, pin=False)]
    results = Results()
    store = tmp_path / "missing-store"
    pool = ProcessPool(store, ShardLayout(8, 8, 1), 1, buffers, results, None)
    try:
        pool.submit(0, ShardTask(index=3, num_sequences=1, documents={}, attrs={}, finite=False))
        assert results.event.wait(60)
    finally:
        pool.close()
        buffers[0].release()
    slot, index, error = results.got[0]
    assert (slot, index) == (0, 3) and "NaN/Inf" in str(error)


def test_a_dead_writer_is_reported(tmp_path: Path) -> None:
    buffers = [ShardBuffers.allocate(SHAPE, pin=False)]
    pool = ProcessPool(tmp_path, ShardLayout(8, 8, 1), 1, buffers, Results(), None)
    try:
        pool.check_alive()
        os.kill(pool.procs[0].pid, signal.SIGKILL)
        pool.procs[0].join(30)
        with pytest.raises(RuntimeError, match=r"died \(shard-writer-0: -9"):
            pool.check_alive()
    finally:
        pool.close()
        buffers[0].release()


def test_a_full_disk_stays_recognisable_across_processes() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("zarr failed") from inner
    except RuntimeError as wrapped:
        assert is_disk_full(_portable(wrapped))


def test_buffers_seen_by_a_writer_process_are_the_parents(tmp_path: Path) -> None:
    """What the parent writes into the shared arena is what the writer process stores."""
    import zarr

    buffers = [ShardBuffers.allocate(SHAPE, pin=False)]
    host = buffers[0].tensors
    host["tokens"][:] = torch.arange(8, dtype=torch.int32)
    host["document_ids"][:] = 0
    host["loss_mask"][:] = 1
    host["hidden"].view(-1)[:] = 1.5
    (tmp_path / "shards").mkdir()
    documents = {"doc_length": np.array([8], np.int32)}
    attrs = {"num_tokens": 8, "num_loss_tokens": 8, "num_documents": 1}
    results = Results()
    pool = ProcessPool(tmp_path, ShardLayout(8, 8, 1), 1, buffers, results, None)
    try:
        pool.submit(0, ShardTask(index=0, num_sequences=1, documents=documents, attrs=attrs))
        assert results.event.wait(60)
    finally:
        pool.close()
    assert results.got[0][2] is None
    group = zarr.open_group(tmp_path / "shards" / "shard-000000", mode="r")
    assert group["tokens"][0].tolist() == list(range(8))
    assert np.all(group["hidden"][...] == np.uint16(0x3FC0))  # bf16 bits of 1.5
    buffers[0].release()


def _mapped(address: int) -> bool:
    """Whether this process maps `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def test_an_interrupted_close_leaves_a_writing_thread_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C in close() while a writer thread encodes its shard: close released the
    buffers (unmapped them) under the thread, which then read freed memory (a segfault: a
    view of an unmapped arena, read in a child process, ended it with SIGSEGV). The thread,
    let go after the interrupt, must read what was written; the pool, stopped, commits
    nothing."""
    import stage1_extract.writer_pools as writer_pools
    from stage1_extract.shard_writer import ShardJob, ShardWriter
    from stage1_extract.writer_pools import ThreadPool

    encoding, go, read = threading.Event(), threading.Event(), []

    def write_shard(store: Path, task: ShardTask, buffers: ShardBuffers, *args: object) -> None:
        arrays = buffers.sequence_arrays(task.num_sequences, 8)  # what zarr encodes from
        encoding.set()
        go.wait(30)
        if read is not None:  # None: the test found the memory unmapped
            read.append(arrays["hidden"].copy())
        args[-1]()  # before_commit: the pool was stopped

    def interrupted(self: ThreadPool) -> None:  # a second Ctrl-C as close() waits for it
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_pools, "write_shard", write_shard)
    monkeypatch.setattr(ThreadPool, "close", interrupted)
    shard = ShardWriter(
        tmp_path,
        ShardLayout(8, 8, 1),
        processes=0,
        threads=1,
        num_todo=1,
        shard_bytes=1 << 20,
        make_buffers=lambda: ShardBuffers.allocate(SHAPE, pin=False),
        watch=None,
    )
    buffers = shard.acquire()
    buffers.tensors["hidden"].view(-1)[:] = 1.5
    address = buffers.tensors["hidden"].data_ptr()
    task = ShardTask(index=0, num_sequences=1, documents={}, attrs={})
    shard.submit(ShardJob(task, buffers, None, torch.tensor(True)))
    assert encoding.wait(30)
    with pytest.raises(KeyboardInterrupt):
        shard.close()
    shard.pool.stop()  # as run._close_writer does then
    mapped = _mapped(address)
    if not mapped:
        read = None
    go.set()
    shard.pool.executor.shutdown(wait=True)
    assert mapped, "the buffers were unmapped while a writer thread still read them"
    assert np.all(read[0] == np.uint16(0x3FC0))  # bf16 bits of 1.5
    with pytest.raises(RuntimeError, match="writers were stopped"):
        shard.raise_errors()


def test_close_ends_the_collector_without_waiting_for_its_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() let the collector see the writers gone only at its next poll of the results
    (0.5 s: 300-500 ms of every close, 11-20 ms now); here the poll is a minute away."""
    import stage1_extract.writer_pools as writer_pools

    monkeypatch.setattr(writer_pools, "COLLECT_POLL_S", 60.0)
    buffers = [ShardBuffers.allocate(SHAPE, pin=False)]
    results = Results()
    pool = ProcessPool(tmp_path, ShardLayout(8, 8, 1), 1, buffers, results, None)
    pool.submit(0, ShardTask(index=3, num_sequences=1, documents={}, attrs={}, finite=False))
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(30)  # a safety net only: the poll would end it after 60 s
    assert not closer.is_alive(), "close() waits for the collector's next poll"
    assert [(slot, index) for slot, index, _ in results.got] == [(0, 3)]  # none lost
    buffers[0].release()
