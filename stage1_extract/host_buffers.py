"""Host memory of one shard: every per-token array laid out in one block of shared memory.

The block is an anonymous memory file (memfd), so writer processes can map the same pages the
target's device-to-host copies fill: a shard is written to disk without being copied between
processes. On CUDA the block is page-locked (cudaHostRegister) so those copies are
asynchronous. A memfd is not limited by the size of /dev/shm (64 MB in many containers).

Legend: M = n * S flat token slots of a shard (n sequences of S tokens), K tapped layers,
D hidden size, k top-k, V vocabulary.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

from common.store import HIDDEN_DTYPES, bf16_to_bits, hidden_row_width

ALIGN = 4096  # every array starts on its own page


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostArena:
    """`nbytes` of shared anonymous memory; pickles (to a writer process) as a mapping of the
    same memory."""

    def __init__(self, nbytes: int, fd: int | None = None) -> None:
        self.nbytes = nbytes
        if fd is None:
            fd = os.memfd_create("dflash-shard")
            os.ftruncate(fd, nbytes)
        self.fd = fd
        self.map = mmap.mmap(fd, nbytes)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Page-lock for asynchronous CUDA copies (what pin_memory does for its own buffers)."""
        error = int(torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes, 0))
        if error != 0:
            raise RuntimeError(
                f"cudaHostRegister of {self.nbytes / 2**30:.2f} GiB of shard buffers failed "
                f"(cudaError {error}); lower store.sequences_per_shard or the number of writers"
            )
        self.pinned = True

    def close(self) -> None:
        """Unpin and let go of the memory: it is unmapped once no view of it is left. Not
        `self.map.close()`: torch.frombuffer keeps a reference to the map, not a buffer
        export, so that unmapped the memory under every tensor and array still viewing it
        (a writer thread stopped by a second Ctrl-C, still encoding its shard, read freed
        memory: a segfault)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes, self.map
        os.close(self.fd)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # DupFd hands the descriptor to the child (only while it is being started)
        return _attach_arena, (reduction.DupFd(self.fd), self.nbytes)


def _attach_arena(dup_fd: Any, nbytes: int) -> HostArena:
    return HostArena(nbytes, dup_fd.detach())


@dataclass(frozen=True)
class BufferShape:
    """What decides a shard's host arrays: M slots, K tapped layers of D, top-k, and V when
    full logits are stored."""

    slots: int
    num_tapped: int
    hidden_size: int
    topk: int
    vocab: int | None
    hidden_dtype: str  # the store's (common.store.HIDDEN_DTYPES)

    def arrays(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        M, K, D, k = self.slots, self.num_tapped, self.hidden_size, self.topk
        scaled = HIDDEN_DTYPES[self.hidden_dtype][1]
        width = hidden_row_width(self.hidden_dtype, D)
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "hidden": ((M, K, width), torch.uint8 if scaled else torch.bfloat16),
        }
        if scaled:
            out["hidden_scale"] = ((M, K), torch.float32)
        out |= {
            "target_argmax": ((M,), torch.int32),
            "topk_ids": ((M, k), torch.int32),
            "topk_logits": ((M, k), torch.float32),
            "logsumexp": ((M,), torch.float32),
        }
        if self.vocab:
            out["logits"] = ((M, self.vocab), torch.bfloat16)
        return out | {
            "tokens": ((M,), torch.int32),
            "loss_mask": ((M,), torch.uint8),
            "position_ids": ((M,), torch.int32),
            "document_ids": ((M,), torch.int32),
        }

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of each array in the arena, and the arena's size."""
        out, at = {}, 0
        for name, (shape, dtype) in self.arrays().items():
            out[name] = at
            nbytes = int(np.prod(shape)) * dtype.itemsize
            at += -(-nbytes // ALIGN) * ALIGN
        return out, max(at, ALIGN)


# arrays the target's forward fills, in the order of its outputs (fill_shard); the rest are
# filled from the packing plan on the host
DEVICE_ARRAYS = ("hidden", "hidden_scale", "target_argmax", "topk_ids", "topk_logits", "logsumexp")


class ShardBuffers:
    """Typed views of one arena: the host arrays of one shard, reused shard after shard."""

    def __init__(self, shape: BufferShape, arena: HostArena) -> None:
        self.shape, self.arena = shape, arena
        offsets, _ = shape.offsets()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (dims, dtype) in shape.arrays().items():
            count = int(np.prod(dims)) * dtype.itemsize
            raw = arena.bytes[offsets[name] : offsets[name] + count]
            self.tensors[name] = raw.view(dtype).view(dims)

    @staticmethod
    def allocate(shape: BufferShape, pin: bool) -> ShardBuffers:
        arena = HostArena(shape.offsets()[1])
        if pin:
            arena.pin()
        return ShardBuffers(shape, arena)

    def release(self) -> None:
        self.tensors.clear()
        self.arena.close()

    def device_arrays(self) -> list[torch.Tensor]:
        """The arrays filled from the target's outputs, in the order of its outputs."""
        names = [*DEVICE_ARRAYS, "logits"]
        return [self.tensors[name] for name in names if name in self.tensors]

    def numpy(self, name: str) -> np.ndarray:
        tensor = self.tensors[name]
        return bf16_to_bits(tensor) if tensor.dtype == torch.bfloat16 else tensor.numpy()

    def sequence_arrays(self, num_sequences: int, seq_len: int) -> dict[str, np.ndarray]:
        """Per-token arrays of FORMAT.md, [n, S, ...], as views of the first n*S slots."""
        m = num_sequences * seq_len
        return {
            name: self.numpy(name)[:m].reshape(num_sequences, seq_len, *dims[1:])
            for name, (dims, _) in self.shape.arrays().items()
        }
