"""stage2_train/row_reader.py reads a shard's rows as zarr does, for every codec layout
extract writes (zstd, crc32c only, blosc + crc32c; rows of one chunk or several, a row that
ends inside its last chunk, chunks never written), fails on bytes that zarr would refuse, and
declines any other layout; and the top-k gather it feeds matches the shifted block gather."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from numcodecs import Zstd
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, TransposeCodec, ZstdCodec

from stage2_train.anchors import block_gather, next_token_gather, next_token_source
from stage2_train.row_reader import RowReader, _decoder, _frame_size

CODECS = {
    "zstd": [ZstdCodec(level=1, checksum=True)],
    "zstd_plain": [ZstdCodec(level=1)],
    "crc32c": [Crc32cCodec()],
    "blosc": [BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=4), Crc32cCodec()],
}


def write(folder: Path, data: np.ndarray, chunk: int, compressors: list, shard_tokens: int):
    """One sharded array as stage1_extract/writer.py lays it out."""
    group = zarr.open_group(folder, mode="a", zarr_format=3)
    array = group.create_array(
        "a",
        shape=data.shape,
        dtype=data.dtype,
        chunks=(1, chunk, *data.shape[2:]),
        shards=(data.shape[0], shard_tokens, *data.shape[2:]),
        compressors=compressors,
        fill_value=0,
    )
    array[...] = data
    return zarr.open_group(folder, mode="r", zarr_format=3)["a"]


def rows_of(array: zarr.Array, folder: Path) -> list[np.ndarray]:
    reader = RowReader.of(array, folder / "a")
    assert reader is not None
    out = []
    for row in range(array.shape[0]):
        buf = np.full(array.shape[1:], 7, array.dtype)  # the reader must write every element
        reader.read_into(row, buf)
        out.append(buf)
    return out


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize(
    ("seq_len", "chunk", "shard_tokens"),
    [(24, 24, 24), (24, 8, 24), (20, 8, 24)],  # one chunk a row, three, the last one cut
)
def test_rows_equal_zarr(tmp_path: Path, codec: str, seq_len: int, chunk: int, shard_tokens: int):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(3, seq_len, 2, 5)).astype(np.float32)
    data[1, :chunk] = 0  # a chunk of fill values: never written (the index says empty)
    array = write(tmp_path, data, chunk, CODECS[codec], shard_tokens)
    for row, got in enumerate(rows_of(array, tmp_path)):
        assert np.array_equal(got, array[row]) and np.array_equal(got, data[row])


def test_uint8_and_int32_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 256, (2, 16, 3, 4), dtype=np.uint8)
    ids = rng.integers(-5, 1000, (2, 16), dtype=np.int32)
    for name, data in (("u8", bits), ("i32", ids)):
        array = write(tmp_path / name, data, 16, CODECS["zstd"], 16)
        rows = rows_of(array, tmp_path / name)
        assert all(np.array_equal(g, d) for g, d in zip(rows, data, strict=True))


def test_damaged_bytes_raise_with_a_checksum_message(tmp_path: Path) -> None:
    data = np.arange(2 * 16 * 4, dtype=np.float32).reshape(2, 16, 4)
    array = write(tmp_path, data, 16, CODECS["zstd"], 16)
    reader = RowReader.of(array, tmp_path / "a")
    (path,) = [p for p in (tmp_path / "a" / "c").rglob("*") if p.is_file()]
    raw = bytearray(path.read_bytes())
    out = np.empty((16, 4), np.float32)
    for at in (len(raw) // 4, len(raw) - 10):  # a chunk's bytes, then the shard index
        flipped = bytearray(raw)
        flipped[at] ^= 0x10
        path.write_bytes(bytes(flipped))
        with pytest.raises(Exception, match="checksum"):
            reader.read_into(0, out)
        with pytest.raises(Exception, match="checksum"):
            array[0]  # zarr refuses the same bytes
    path.write_bytes(bytes(raw[:100]))  # cut: shorter than its index says
    with pytest.raises(ValueError):
        reader.read_into(0, out)
    path.unlink()  # missing: the fill value, as zarr reads it (the recorded sizes catch it)
    reader.read_into(1, out)
    assert not out.any() and not array[1].any()


@pytest.mark.parametrize("size", [1, 10, 255, 256, 300, 70_000, 5_898_240])
def test_a_frame_of_another_size_never_fills_part_of_the_row(size: int) -> None:
    """numcodecs decodes a smaller frame into the start of a larger buffer without a word;
    the reader reads the size the frame declares and refuses it, as zarr does."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    frame = np.frombuffer(Zstd(level=1).encode(data), np.uint8)
    assert _frame_size(frame) == size
    decode = _decoder((BytesCodec(), ZstdCodec(level=1)))
    out = np.empty(size, np.uint8)
    decode(frame, out)
    assert np.array_equal(out, data)
    with pytest.raises(ValueError, match="expected"):
        decode(frame, np.empty(size + 1, np.uint8))


def test_other_layouts_are_declined(tmp_path: Path) -> None:
    data = np.zeros((2, 8, 3), np.float32)
    group = zarr.open_group(tmp_path, mode="w", zarr_format=3)
    plain = group.create_array("p", shape=data.shape, dtype=data.dtype, chunks=(1, 8, 3))
    assert RowReader.of(plain, tmp_path / "p") is None  # not sharded
    split = group.create_array(
        "s", shape=data.shape, dtype=data.dtype, chunks=(1, 8, 3), shards=(1, 8, 3)
    )
    assert RowReader.of(split, tmp_path / "s") is None  # a shard file per row
    moved = group.create_array(
        "t",
        shape=data.shape,
        dtype=data.dtype,
        chunks=(1, 8, 3),
        shards=(2, 8, 3),
        filters=[TransposeCodec(order=(0, 2, 1))],
    )
    assert RowReader.of(moved, tmp_path / "t") is None  # a codec it does not know
    big = group.create_array("b", shape=data.shape, dtype=">f4", chunks=(1, 8, 3), shards=(2, 8, 3))
    assert RowReader.of(big, tmp_path / "b") is None  # big-endian


@pytest.mark.parametrize("seed", range(4))
def test_next_token_gather_equals_the_shifted_block_gather(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    S, A, B, k = 40, 12, 6, 3
    source_Sk = torch.randn(S, k, generator=g)
    anchors_A = torch.randint(0, S, (A,), generator=g)
    anchors_A[-3:] = -1  # padding
    want = block_gather(anchors_A, next_token_source(source_Sk), B)
    assert torch.equal(next_token_gather(anchors_A, source_Sk, B), want)
    out = torch.empty(A, B, k)
    assert next_token_gather(anchors_A, source_Sk, B, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, want)
