"""Shard writing: host buffers, the Zarr v3 layout of FORMAT.md, verify-then-rename commits, and
background writer threads so the next target forward never waits on the disk.

A shard is assembled in a `ShardBuffers` (pinned host memory on CUDA, filled by non-blocking
device-to-host copies), handed to `ShardWriter.submit`, and written by a worker thread into
`shards/.tmp-shard-NNNNNN-<pid>/`, read back, checked, and renamed to `shards/shard-NNNNNN/`.
The pool of buffers is bounded (writer_threads + 1), which is the backpressure: when every
buffer waits for the disk, the producer blocks in `acquire`.

Legend: M = n * S flat token slots of a shard (n sequences of S tokens), K tapped layers,
D hidden size, k top-k, V vocabulary, P documents (pieces) of the shard.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.codecs import ZstdCodec

from common.durable import commit_folder
from common.store import SHARD_ATTR, StoreError, bf16_to_bits, shard_name, shards_dir

KILL_ENV = "DFLASH_TEST_KILL_AFTER_COMMITS"  # test hook: SIGKILL self after this many commits


@dataclass
class ShardBuffers:
    """Host arrays of one shard, flat over token slots; reused shard after shard."""

    hidden_MKD: torch.Tensor  # bf16, or uint8 float8_e4m3fn bits
    hidden_scale_MK: torch.Tensor | None  # float32, only with fp8 hidden states
    argmax_M: torch.Tensor  # int32
    topk_ids_Mk: torch.Tensor  # int32
    topk_logits_Mk: torch.Tensor  # float32
    lse_M: torch.Tensor  # float32
    logits_MV: torch.Tensor | None  # bf16
    tokens_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    loss_mask_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    position_ids_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    document_ids_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @staticmethod
    def allocate(
        slots: int, K: int, D: int, k: int, V: int | None, pin: bool, *, fp8: bool
    ) -> ShardBuffers:
        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        return ShardBuffers(
            hidden_MKD=host(slots, K, D, dtype=torch.uint8 if fp8 else torch.bfloat16),
            hidden_scale_MK=host(slots, K, dtype=torch.float32) if fp8 else None,
            argmax_M=host(slots, dtype=torch.int32),
            topk_ids_Mk=host(slots, k, dtype=torch.int32),
            topk_logits_Mk=host(slots, k, dtype=torch.float32),
            lse_M=host(slots, dtype=torch.float32),
            logits_MV=host(slots, V, dtype=torch.bfloat16) if V else None,
        )

    def device_arrays(self) -> list[torch.Tensor]:
        """The arrays filled from the target's outputs (zeroed on padding by the producer), in
        the order of the target's outputs (fill_shard)."""
        out = [self.hidden_MKD]
        out += [self.hidden_scale_MK] if self.hidden_scale_MK is not None else []
        out += [self.argmax_M, self.topk_ids_Mk, self.topk_logits_Mk, self.lse_M]
        return out + ([self.logits_MV] if self.logits_MV is not None else [])

    def sequence_arrays(self, num_sequences: int, seq_len: int) -> dict[str, np.ndarray]:
        """Per-token arrays of FORMAT.md, [n, S, ...], as views of the first n*S slots."""
        m = num_sequences * seq_len

        def shaped(a: np.ndarray) -> np.ndarray:
            return a[:m].reshape(num_sequences, seq_len, *a.shape[1:])

        out = {
            "tokens": shaped(self.tokens_M),
            "loss_mask": shaped(self.loss_mask_M),
            "position_ids": shaped(self.position_ids_M),
            "document_ids": shaped(self.document_ids_M),
            "hidden": shaped(
                self.hidden_MKD.numpy()
                if self.hidden_MKD.dtype == torch.uint8
                else bf16_to_bits(self.hidden_MKD[:m])
            ),
            "target_argmax": shaped(self.argmax_M.numpy()),
            "topk_ids": shaped(self.topk_ids_Mk.numpy()),
            "topk_logits": shaped(self.topk_logits_Mk.numpy()),
            "logsumexp": shaped(self.lse_M.numpy()),
        }
        if self.hidden_scale_MK is not None:
            out["hidden_scale"] = shaped(self.hidden_scale_MK.numpy())
        if self.logits_MV is not None:
            out["logits"] = shaped(bf16_to_bits(self.logits_MV[:m]))
        return out


@dataclass
class ShardJob:
    """One filled shard waiting to be written."""

    index: int
    num_sequences: int
    buffers: ShardBuffers
    documents: dict[str, np.ndarray]  # FORMAT.md per-document arrays, [P]
    attrs: dict[str, Any]  # the shard's `dflash_shard` attributes
    ready: torch.cuda.Event | None  # recorded after the last device-to-host copy
    finite: torch.Tensor  # bool, on the host once `ready`: no NaN/Inf in any stored float


@dataclass(frozen=True)
class ShardLayout:
    seq_len: int
    chunk_tokens: int
    compression_level: int


def _is_disk_full(err: BaseException | None) -> bool:
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__
    return False


def write_shard(store: Path, job: ShardJob, layout: ShardLayout) -> Path:
    """Write `job` to a temporary group, read it back, check it, rename it into place."""
    final = shards_dir(store) / shard_name(job.index)
    tmp = shards_dir(store) / f".tmp-{shard_name(job.index)}-{os.getpid()}"
    if not bool(job.finite):
        raise StoreError(
            f"shard {job.index}: the target produced NaN/Inf hidden states or logits; check "
            "target.dtype and the model weights"
        )
    arrays = job.buffers.sequence_arrays(job.num_sequences, layout.seq_len)
    compressors = ZstdCodec(level=layout.compression_level) if layout.compression_level else None
    tok_chunk = min(layout.chunk_tokens, layout.seq_len)
    shard_tokens = -(-layout.seq_len // tok_chunk) * tok_chunk
    try:
        group = zarr.open_group(tmp, mode="w", zarr_format=3, attributes={SHARD_ATTR: job.attrs})
        for name, data in arrays.items():
            trailing = data.shape[2:]
            group.create_array(
                name,
                data=data,
                chunks=(1, tok_chunk, *trailing),
                shards=(job.num_sequences, shard_tokens, *trailing),
                compressors=compressors,
                # zarr's default compares every chunk with the fill value to skip empty ones:
                # a full extra pass over the data that made writes ~1.7x slower (bench/zarr_write.py)
                config={"write_empty_chunks": True},
            )
        for name, data in job.documents.items():
            group.create_array(name, data=data, chunks=data.shape, compressors=compressors)
        _verify(tmp, arrays, job)
        commit_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _verify(tmp: Path, arrays: dict[str, np.ndarray], job: ShardJob) -> None:
    """Read the shard back: every array present with its shape and dtype; the small arrays
    equal to what was written; first and last sequence of the big ones too; counts agree."""
    group = zarr.open_group(tmp, mode="r")
    expected = {**arrays, **job.documents}
    for name, data in expected.items():
        stored = group[name]
        if stored.shape != data.shape or stored.dtype != data.dtype:
            raise StoreError(
                f"shard {job.index}: {name} read back as {stored.shape} {stored.dtype}"
            )
        big = name in ("hidden", "logits")
        probe = (slice(0, 1),) if big else ()
        ok = np.array_equal(stored[probe], data[probe])
        if big:
            ok = ok and np.array_equal(stored[-1:], data[-1:])
        if not ok:
            raise StoreError(f"shard {job.index}: {name} read back differs from what was written")
    num_docs = len(job.documents["doc_length"])
    if (
        int((arrays["document_ids"] >= 0).sum()) != job.attrs["num_tokens"]
        or int(arrays["loss_mask"].sum()) != job.attrs["num_loss_tokens"]
        or num_docs != job.attrs["num_documents"]
        or int(job.documents["doc_length"].sum()) != job.attrs["num_tokens"]
    ):
        raise StoreError(f"shard {job.index}: token or document counts disagree with its arrays")


class ShardWriter:
    """Background writer threads with a bounded pool of reusable shard buffers."""

    def __init__(
        self,
        store: Path,
        layout: ShardLayout,
        threads: int,
        num_todo: int,
        shard_bytes: int,
        make_buffers: Any,
    ) -> None:
        self.store, self.layout = store, layout
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard-writer")
        self.free: queue.Queue[ShardBuffers] = queue.Queue()
        self.num_buffers, self.make_buffers = threads + 1, make_buffers
        self.allocated = 0
        self.futures: list[Future[Path]] = []
        self.shards_left, self.shard_bytes = num_todo, shard_bytes
        self.kill_after = int(os.environ.get(KILL_ENV, "0"))
        self.commits = 0
        self.lock = threading.Lock()  # counters below are updated from writer threads

    def acquire(self) -> ShardBuffers:
        """A free buffer set; blocks while every set waits for the disk (backpressure)."""
        self.raise_errors()
        if self.free.empty() and self.allocated < self.num_buffers:
            self.allocated += 1
            return self.make_buffers()
        while True:
            try:
                return self.free.get(timeout=1.0)
            except queue.Empty:
                self.raise_errors()

    def submit(self, job: ShardJob) -> None:
        self.futures.append(self.pool.submit(self._write, job))

    def _write(self, job: ShardJob) -> Path:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            path = write_shard(self.store, job, self.layout)
        except OSError as err:
            if not _is_disk_full(err):
                raise
            free = shutil.disk_usage(self.store).free
            need = self.shards_left * self.shard_bytes
            raise StoreError(
                f"disk full while writing shard {job.index} of store {self.store}: "
                f"{free / 2**30:.2f} GiB free, the {self.shards_left} shard(s) left need up to "
                f"{need / 2**30:.2f} GiB (uncompressed); free space (or move --out) and rerun "
                "the same command to resume; committed shards are kept"
            ) from err
        finally:
            self.free.put(job.buffers)
        with self.lock:
            self.shards_left -= 1
            self.commits += 1
            kill = self.kill_after and self.commits >= self.kill_after
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    def raise_errors(self) -> None:
        for fut in self.futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def close(self) -> None:
        """Wait for every submitted shard (committed ones stay committed on errors)."""
        self.pool.shutdown(wait=True)
        self.raise_errors()
