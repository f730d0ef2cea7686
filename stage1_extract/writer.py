"""Writing one shard: the Zarr v3 layout of FORMAT.md and the verify-then-rename commit.

A writer (stage1_extract.shard_writer runs them in the background) writes a shard's buffers
into `shards/.tmp-shard-NNNNNN-<pid>/`, reads them back, checks them, and renames the folder
to `shards/shard-NNNNNN/`, so a shard is visible only once it is complete. Just before the rename
it records the size of every file of the shard in the shard's attributes (common/store_files.py),
which readers check: zarr would read a deleted file as zeros. A writer process passes
`before_commit`, which raises once its extraction has ended (stage1_extract/writer_pools.py):
the shard is then not committed and its temporary folder is removed.

Legend: P documents (pieces) of a shard.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numcodecs.blosc
import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from common.durable import NO_SPACE_ERRNOS, commit_folder
from common.store import SHARD_ATTR, StoreError, shard_name, shards_dir
from common.store_files import record_shard_files
from stage1_extract.host_buffers import ShardBuffers


@dataclass
class ShardTask:
    """What a writer needs besides the buffers: small, so it crosses to a writer process."""

    index: int
    num_sequences: int
    documents: dict[str, np.ndarray]  # FORMAT.md per-document arrays, [P]
    attrs: dict[str, Any]  # the shard's `dflash_shard` attributes
    finite: bool = True  # no NaN/Inf in any stored float (known once the copies are done)


@dataclass(frozen=True)
class ShardLayout:
    seq_len: int
    chunk_tokens: int
    compression_level: int
    byte_shuffle: bool = False


# Arrays of floats of 2 or more bytes: their exponent bytes repeat, their mantissa bytes do
# not, and zstd sees them interleaved. Grouping byte k of every element first (Blosc's byte
# shuffle) lets it find the repeats: pystd-28m's bf16 hidden states 1.90x instead of 1.53x,
# top-k logits 1.56x instead of 1.38x, and the chunks decode faster (less to decompress).
# Blosc splits a chunk into blocks compressed apart; blocks under ~1 MiB lost most of the gain.
SHUFFLED_ARRAYS = ("hidden", "topk_logits", "logsumexp", "logits")
BLOSC_BLOCK_BYTES = 1 << 20
# Blosc refuses a chunk over ~2 GiB (full logits reach it: bf16, vocab 152k, 8192 tokens)
BLOSC_MAX_BYTES = numcodecs.blosc.MAX_BUFFERSIZE


def chunk_codecs(name: str, itemsize: int, chunk_bytes: int, layout: ShardLayout) -> list[Any]:
    """The bytes-to-bytes codecs of one array's chunks. Every chunk is checksummed: a flipped
    bit on disk must fail to decode, not train silently (Blosc has no checksum: crc32c)."""
    level = layout.compression_level
    if not level:
        return [Crc32cCodec()]
    shuffle = layout.byte_shuffle and itemsize > 1 and name in SHUFFLED_ARRAYS
    if shuffle and chunk_bytes <= BLOSC_MAX_BYTES:
        blosc = BloscCodec(
            cname="zstd",
            clevel=level,
            shuffle="shuffle",
            typesize=itemsize,
            blocksize=BLOSC_BLOCK_BYTES,
        )
        return [blosc, Crc32cCodec()]
    return [ZstdCodec(level=level, checksum=True)]


# A disk full, a quota, or a file-size limit (`ulimit -f`; SIGXFSZ is ignored so that it shows
# as EFBIG instead of killing the process): no rerun succeeds until the user makes room.


def no_space_errno(err: BaseException | None) -> int | None:
    """The NO_SPACE_ERRNOS errno of `err` or of an error it was raised from, else None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def is_disk_full(err: BaseException | None) -> bool:
    return no_space_errno(err) is not None


def write_shard(
    store: Path,
    task: ShardTask,
    buffers: ShardBuffers,
    layout: ShardLayout,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write one shard to a temporary group, read it back, check it, rename it into place
    (`before_commit` runs just before the rename and raises to call it off)."""
    final = shards_dir(store) / shard_name(task.index)
    tmp = shards_dir(store) / f".tmp-{shard_name(task.index)}-{os.getpid()}"
    if not task.finite:
        raise StoreError(
            f"shard {task.index}: the target produced NaN/Inf hidden states or logits; check "
            "target.dtype and the model weights"
        )
    arrays = buffers.sequence_arrays(task.num_sequences, layout.seq_len)
    tok_chunk = min(layout.chunk_tokens, layout.seq_len)
    shard_tokens = -(-layout.seq_len // tok_chunk) * tok_chunk
    try:
        group = zarr.open_group(tmp, mode="w", zarr_format=3, attributes={SHARD_ATTR: task.attrs})
        for name, data in arrays.items():
            trailing = data.shape[2:]
            chunk_bytes = tok_chunk * math.prod(trailing) * data.dtype.itemsize
            group.create_array(
                name,
                data=data,
                chunks=(1, tok_chunk, *trailing),
                shards=(task.num_sequences, shard_tokens, *trailing),
                compressors=chunk_codecs(name, data.dtype.itemsize, chunk_bytes, layout),
                # zarr's default compares every chunk with the fill value to skip empty ones:
                # a full extra pass over the data that made writes ~1.7x slower (bench/zarr_write.py)
                config={"write_empty_chunks": True},
            )
        for name, data in task.documents.items():
            codecs = chunk_codecs(name, data.dtype.itemsize, data.nbytes, layout)
            group.create_array(name, data=data, chunks=data.shape, compressors=codecs)
        _verify(tmp, arrays, task)
        record_shard_files(tmp)
        commit_folder(tmp, final, before_commit)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _verify(tmp: Path, arrays: dict[str, np.ndarray], task: ShardTask) -> None:
    """Read the shard back: every array present with its shape and dtype; the small arrays
    equal to what was written; first and last sequence of the big ones too; counts agree."""
    group = zarr.open_group(tmp, mode="r")
    expected = {**arrays, **task.documents}
    for name, data in expected.items():
        stored = group[name]
        if stored.shape != data.shape or stored.dtype != data.dtype:
            raise StoreError(
                f"shard {task.index}: {name} read back as {stored.shape} {stored.dtype}"
            )
        big = name in ("hidden", "logits")
        probe = (slice(0, 1),) if big else ()
        ok = np.array_equal(stored[probe], data[probe])
        if big:
            ok = ok and np.array_equal(stored[-1:], data[-1:])
        if not ok:
            raise StoreError(f"shard {task.index}: {name} read back differs from what was written")
    num_docs = len(task.documents["doc_length"])
    if (
        int((arrays["document_ids"] >= 0).sum()) != task.attrs["num_tokens"]
        or int(arrays["loss_mask"].sum()) != task.attrs["num_loss_tokens"]
        or num_docs != task.attrs["num_documents"]
        or int(task.documents["doc_length"].sum()) != task.attrs["num_tokens"]
    ):
        raise StoreError(f"shard {task.index}: token or document counts disagree with its arrays")
