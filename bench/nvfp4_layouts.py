"""What other byte layouts of an nvfp4 store's `hidden` would save, and what they cost a reader.

An nvfp4 row is D/2 bytes of 4-bit codes, then D/16 e4m3 block scales (FORMAT.md). zstd sees
the scales interleaved with near-random codes. For every inner chunk of every shard (the
store's own `(1, chunk_tokens, K, W)`) this compresses, with zstd at the store's level:

- ``rows``: the chunk as the store writes it (the baseline);
- ``split``: the codes and the scales as two streams (a separate scales array would do this);
- ``transpose_w_first``: byte column-major ([W, T, K], zarr's transpose codec would do this);
- ``column9``: nine chunks D/16 bytes wide (the codes in eight, the scales in the ninth), what
  chunking `hidden` by D/16 along its last axis gives with no change to the format.

Then it rewrites one shard's `hidden` as a zarr array chunked as the store is and as column9,
and times writing it and reading it back a sequence at a time (process CPU seconds, the read
best of --repeats), as a loader worker reads rows. One JSON line per layout on stdout.
`--synthetic D,D,...` instead times rows and column9 on made-up rows (random codes, block
scales of four values) of each hidden size D: the chunks' overhead apart from real features.

    python bench/nvfp4_layouts.py --store STORE        # STORE: an nvfp4 store (dflash extract)
    python bench/nvfp4_layouts.py --synthetic 384,2048,4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from numcodecs import Zstd
from zarr.codecs import ZstdCodec

from common.fp4 import nvfp4_codes_bytes
from common.store import open_store, shards_dir


def layouts(chunk_TKW: np.ndarray) -> dict[str, list[np.ndarray]]:
    """The byte streams each layout compresses apart, for one chunk [T, K, W]."""
    width = chunk_TKW.shape[-1]
    codes = nvfp4_codes_bytes(width)  # D/2 of the row's 9 * D/16 bytes
    column = width // 9
    return {
        "rows": [chunk_TKW],
        "split": [chunk_TKW[..., :codes], chunk_TKW[..., codes:]],
        "transpose_w_first": [chunk_TKW.transpose(2, 0, 1)],
        "column9": [chunk_TKW[..., j * column : (j + 1) * column] for j in range(9)],
    }


def compressed_bytes(store: Path, level: int, chunk_tokens: int) -> tuple[dict[str, int], int]:
    """Each layout's zstd bytes over every chunk of every shard, and the tokens they hold."""
    codec = Zstd(level=level)
    totals: dict[str, int] = {}
    tokens = 0
    for shard in sorted(shards_dir(store).glob("shard-*")):
        hidden = zarr.open_group(shard, mode="r")["hidden"][:]  # [n, S, K, W]
        for sequence in hidden:
            for start in range(0, sequence.shape[0], chunk_tokens):
                chunk = sequence[start : start + chunk_tokens]
                tokens += chunk.shape[0]
                for name, streams in layouts(chunk).items():
                    sizes = [len(codec.encode(np.ascontiguousarray(s).tobytes())) for s in streams]
                    totals[name] = totals.get(name, 0) + sum(sizes)
    return totals, tokens


def write_read_cpu_s(
    hidden: np.ndarray, chunk_width: int, chunk_tokens: int, level: int, repeats: int
) -> tuple[float, float]:
    """Process CPU seconds to write `hidden` [n, S, K, W] as a sharded zarr array chunked
    (1, chunk_tokens, K, chunk_width), and to read it back a sequence at a time (best of
    `repeats`)."""
    n, S, K, W = hidden.shape
    folder = Path(tempfile.mkdtemp(prefix="nvfp4-layout-"))
    try:
        start = time.process_time()
        zarr.create_array(
            folder / "hidden",
            data=hidden,
            chunks=(1, min(chunk_tokens, S), K, chunk_width),
            shards=(n, S, K, W),
            compressors=[ZstdCodec(level=level, checksum=True)],
            config={"write_empty_chunks": True},
        )
        written = time.process_time() - start
        array = zarr.open_array(folder / "hidden", mode="r")
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            for i in range(n):
                array[i]
            best = min(best, time.process_time() - start)
        return written, best
    finally:
        shutil.rmtree(folder)


def timed_chunkings(hidden: np.ndarray, chunk_tokens: int, level: int, repeats: int) -> dict:
    """rows and column9's write and read CPU ms a sequence, and column9's ratios to rows'."""
    width, n = hidden.shape[-1], hidden.shape[0]
    record: dict = {}
    for name, chunk_width in (("rows", width), ("column9", width // 9)):
        write_s, read_s = write_read_cpu_s(hidden, chunk_width, chunk_tokens, level, repeats)
        record[name] = {
            "write_cpu_ms_per_sequence": round(write_s / n * 1e3, 2),
            "read_cpu_ms_per_sequence": round(read_s / n * 1e3, 2),
        }
    for what in ("write", "read"):
        key = f"{what}_cpu_ms_per_sequence"
        record[f"column9_{what}_vs_rows"] = round(record["column9"][key] / record["rows"][key], 2)
    return record


def synthetic(widths: list[int], repeats: int) -> None:
    """Write/read timings of rows and column9 on made-up rows of each hidden size."""
    rng = np.random.default_rng(0)
    for hidden_size in widths:
        if hidden_size % 16:
            raise SystemExit(f"--synthetic {hidden_size}: an nvfp4 hidden size is a multiple of 16")
        shape = (2, 3072, 5)  # two sequences of 3,072 tokens, five tapped layers
        codes = rng.integers(0, 256, size=(*shape, hidden_size // 2), dtype=np.uint8)
        scales = rng.integers(100, 104, size=(*shape, hidden_size // 16), dtype=np.uint8)
        hidden = np.concatenate([codes, scales], axis=-1)
        record = {"synthetic_hidden_size": hidden_size, "zstd_level": 1}
        print(json.dumps(record | timed_chunkings(hidden, 1024, 1, repeats)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="an nvfp4 store")
    parser.add_argument(
        "--synthetic",
        type=lambda s: [int(d) for d in s.split(",")],
        help="comma-separated hidden sizes: time made-up rows instead of a store's",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.synthetic:
        synthetic(args.synthetic, args.repeats)
        return
    if args.store is None:
        parser.error("give --store STORE (an nvfp4 store) or --synthetic D,D,...")
    info = open_store(args.store)
    if info.hidden_dtype != "nvfp4":
        raise SystemExit(
            f"{args.store}: hidden_dtype is {info.hidden_dtype}; this needs an nvfp4 store"
        )
    first = sorted(shards_dir(args.store).glob("shard-*"))[0]
    stored = zarr.open_group(first, mode="r")["hidden"]
    # the store's own chunking and zstd level
    chunk_tokens = stored.chunks[1]
    codec = stored.compressors[0] if stored.compressors else None
    level = getattr(codec, "level", 0)
    totals, tokens = compressed_bytes(args.store, level, chunk_tokens)
    timings = timed_chunkings(stored[:], chunk_tokens, level, args.repeats)
    for name, size in totals.items():
        record = {
            "layout": name,
            "hidden_bytes_per_token": round(size / tokens, 1),
            "vs_rows": round(size / totals["rows"], 4),
            "tokens": tokens,
            "row_bytes": stored.shape[-1],
            "zstd_level": level,
        }
        record |= timings.get(name, {})
        if name == "column9":
            record |= {k: v for k, v in timings.items() if k.startswith("column9_")}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
