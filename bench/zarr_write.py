"""Micro-benchmark of the shard write path: one Zarr v3 sharded array of bf16 bits, as the
extractor writes `hidden`, with and without zarr's empty-chunk check and zstd. CPU only.

    python bench/zarr_write.py [--sequences 4] [--work /tmp/zarr-write]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

K, D, S, CHUNK = 5, 4096, 3072, 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--work", default="/tmp/zarr-write")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    n = args.sequences
    # bf16-like bits with realistic entropy: random normals rounded through fp16
    values = np.random.default_rng(0).standard_normal((n, S, K, D), dtype=np.float32) * 3
    bits = values.astype(np.float16).view(np.uint16)
    work = Path(args.work)
    for write_empty in (False, True):
        for zstd in (True, False):
            best = float("inf")
            for _ in range(args.repeats):
                shutil.rmtree(work, ignore_errors=True)
                start = time.perf_counter()
                group = zarr.open_group(work, mode="w", zarr_format=3)
                group.create_array(
                    "hidden",
                    data=bits,
                    chunks=(1, CHUNK, K, D),
                    shards=(n, S, K, D),
                    compressors=ZstdCodec(level=1) if zstd else None,
                    config={"write_empty_chunks": write_empty},
                )
                best = min(best, time.perf_counter() - start)
            print(
                json.dumps(
                    {
                        "write_empty_chunks": write_empty,
                        "zstd1": zstd,
                        "GB_per_s": round(bits.nbytes / best / 1e9, 3),
                    }
                )
            )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
