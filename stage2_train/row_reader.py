"""One row of a shard's array read straight from its file into a buffer the caller gives.

Each per-token array of a shard is one Zarr v3 sharded array in a single file (FORMAT.md,
stage1_extract/writer.py): the row's inner chunks of `c` tokens, each `bytes` then zstd (or
crc32c, or blosc + crc32c), and at the end of the file the index of every chunk (offset and
length, uint64) with its crc32c. zarr reads a row through its async codec pipeline at ~1 ms of
Python per array whatever its size, ten arrays a row; here a row costs two `pread`s per array
and the decode itself, by the same numcodecs codecs zarr uses (so the same checksum errors),
straight into the caller's buffer (the batch's own: no copy after the decode).

`RowReader.of(array, file)` returns None for any other layout (a store written by other
code): StoreSequences then reads that array through zarr. As in zarr, a missing file or chunk
reads as the fill value; the loader's recorded file sizes (common/store_files.py) catch it.

    reader = RowReader.of(group["hidden"], shard_folder / "hidden")
    reader.read_into(row, out)   # out: [S, ...] numpy array of the array's dtype, writable
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    Endian,
    ShardingCodec,
    ShardingCodecIndexLocation,
    ZstdCodec,
)
from zarr.core.chunk_grids import RegularChunkGrid

EMPTY = 2**64 - 1  # zarr's index entry of a chunk never written (it reads as the fill value)
ZSTD_MAGIC = 0xFD2FB528


def _crc_checked(data: np.ndarray) -> np.ndarray:
    """`data` (uint8) less its trailing crc32c, which must match (zarr's Crc32cCodec, same
    message)."""
    inner, stored = data[:-4], data[-4:].tobytes()
    computed = np.uint32(google_crc32c.value(inner)).tobytes()
    if computed != stored:
        raise ValueError(
            f"Stored and computed checksum do not match. Stored: {stored!r}. "
            f"Computed: {computed!r}."
        )
    return inner


def _copy_into(data: np.ndarray, out: np.ndarray) -> None:
    if data.nbytes != out.nbytes:
        raise ValueError(f"chunk of {data.nbytes} bytes, {out.nbytes} expected")
    out.reshape(-1).view(np.uint8)[:] = data


def _frame_size(data: np.ndarray) -> int | None:
    """The content size a zstd frame header declares (RFC 8878, 3.1.1.1), or None."""
    if data.size < 6 or int.from_bytes(data[:4].tobytes(), "little") != ZSTD_MAGIC:
        return None
    descriptor = int(data[4])
    single_segment = (descriptor >> 5) & 1
    size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    at = 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3]  # window, dictionary id
    if size_bytes == 0 or data.size < at + size_bytes:
        return None
    size = int.from_bytes(data[at : at + size_bytes].tobytes(), "little")
    return size + 256 if size_bytes == 2 else size


def _little_bytes(codec: object) -> bool:
    return isinstance(codec, BytesCodec) and codec.endian in (None, Endian.little)


def _decoder(codecs: tuple) -> Callable[[np.ndarray, np.ndarray], None] | None:
    """Decode one inner chunk's bytes into `out` (C-contiguous, its exact shape), or None for
    codecs this reader does not know."""
    head, *rest = codecs
    if not _little_bytes(head):
        return None
    kinds = tuple(type(codec) for codec in rest)
    if kinds == (ZstdCodec,):
        zstd = numcodecs.Zstd()

        def decode(data: np.ndarray, out: np.ndarray) -> None:
            # numcodecs fills the start of a larger `out` without a word: only a frame that
            # declares out's size goes straight into it; others are decoded, then checked
            if _frame_size(data) == out.nbytes:
                zstd.decode(data, out=out)
            else:
                _copy_into(np.frombuffer(zstd.decode(data), np.uint8), out)

        return decode
    if kinds == (Crc32cCodec,):
        return lambda data, out: _copy_into(_crc_checked(data), out)
    if kinds == (BloscCodec, Crc32cCodec):
        blosc = numcodecs.Blosc()
        return lambda data, out: _copy_into(
            np.frombuffer(blosc.decode(_crc_checked(data)), np.uint8), out
        )
    return None


@dataclass(frozen=True)
class RowReader:
    """Where the inner chunks of one array's rows lie in its shard file, and how to decode them."""

    path: str  # the shard file
    rows: int  # rows of the shard (sequences)
    row_len: int  # S, tokens a row
    chunk_len: int  # c, tokens an inner chunk
    chunks_per_row: int  # inner chunks of a row in the shard grid (>= ceil(S / c))
    fill_value: np.generic
    decode: Callable[[np.ndarray, np.ndarray], None]

    @classmethod
    def of(cls, array: zarr.Array, folder: Path) -> RowReader | None:
        """A reader of `array` (opened from shard folder `folder`/..., files in `folder`), or None
        when its layout is not the one extract writes: one shard file, index at its end,
        inner chunks of (1, c, whole trailing dims), little-endian data."""
        meta = array.metadata
        shape, dtype = tuple(meta.shape), np.dtype(array.dtype)
        if meta.zarr_format != 3 or len(shape) < 2 or len(meta.codecs) != 1:
            return None
        if sys.byteorder != "little" or dtype.byteorder == ">" or dtype.kind not in "biuf":
            return None
        (shard,), grid = meta.codecs, meta.chunk_grid
        if not isinstance(shard, ShardingCodec) or not isinstance(grid, RegularChunkGrid):
            return None
        outer, inner = tuple(grid.chunk_shape), tuple(shard.chunk_shape)
        if outer[0] != shape[0] or outer[1] < shape[1] or outer[2:] != shape[2:]:
            return None  # more than one shard file
        if inner[0] != 1 or inner[2:] != shape[2:] or outer[1] % inner[1]:
            return None
        index = tuple(shard.index_codecs)
        if len(index) != 2 or not _little_bytes(index[0]) or not isinstance(index[1], Crc32cCodec):
            return None
        if shard.index_location != ShardingCodecIndexLocation.end:
            return None
        decode = _decoder(tuple(shard.codecs))
        if decode is None:
            return None
        return cls(
            path=str(folder / meta.encode_chunk_key((0,) * len(shape))),
            rows=shape[0],
            row_len=shape[1],
            chunk_len=inner[1],
            chunks_per_row=outer[1] // inner[1],
            fill_value=dtype.type(meta.fill_value),
            decode=decode,
        )

    def read_into(self, row: int, out: np.ndarray) -> None:
        """Row `row` decoded into `out` ([S, ...], C-contiguous, the array's dtype). Raises on
        bytes that fail to decode or to checksum, or a file shorter than its index says."""
        assert out.flags.c_contiguous and out.shape[0] == self.row_len, out.shape
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:  # zarr reads a missing shard file as the fill value
            out[...] = self.fill_value
            return
        try:
            entries = self.rows * self.chunks_per_row
            index_bytes = entries * 16 + 4
            size = os.fstat(fd).st_size
            if size < index_bytes:
                raise ValueError(f"shard file of {size} bytes, shorter than its index")
            raw = np.frombuffer(os.pread(fd, index_bytes, size - index_bytes), np.uint8)
            index = np.frombuffer(_crc_checked(raw), "<u8").reshape(entries, 2)
            first = row * self.chunks_per_row
            for j in range(-(-self.row_len // self.chunk_len)):
                offset, length = (int(v) for v in index[first + j])
                lo, hi = j * self.chunk_len, min((j + 1) * self.chunk_len, self.row_len)
                if offset == EMPTY and length == EMPTY:
                    out[lo:hi] = self.fill_value
                    continue
                data = np.frombuffer(os.pread(fd, length, offset), np.uint8)
                if data.nbytes != length:
                    raise ValueError(f"chunk of {length} bytes at {offset}: {data.nbytes} read")
                if hi - lo == self.chunk_len:
                    self.decode(data, out[lo:hi])
                else:  # the last chunk of a row that ends inside it: decode whole, keep the start
                    whole = np.empty((self.chunk_len, *out.shape[1:]), out.dtype)
                    self.decode(data, whole)
                    out[lo:hi] = whole[: hi - lo]
        finally:
            os.close(fd)
