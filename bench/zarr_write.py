"""Micro-benchmark of the shard write path: one Zarr v3 sharded array of bf16 bits, as the
extractor writes `hidden`, with and without zarr's empty-chunk check and zstd; with
`--parallel N`, N such shards written at once from N threads of one process and from N
processes (what `run.writer_processes` chooses between). CPU only.

    python bench/zarr_write.py [--sequences 4] [--work /tmp/zarr-write] [--parallel 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

K, D, S, CHUNK = 5, 4096, 3072, 1024


def make_bits(n: int) -> np.ndarray:
    """bf16-like bits with realistic entropy: random normals rounded through fp16."""
    values = np.random.default_rng(0).standard_normal((n, S, K, D), dtype=np.float32) * 3
    return values.astype(np.float16).view(np.uint16)


def write(bits: np.ndarray, folder: Path, zstd: bool = True, write_empty: bool = True) -> None:
    group = zarr.open_group(folder, mode="w", zarr_format=3)
    group.create_array(
        "hidden",
        data=bits,
        chunks=(1, CHUNK, K, D),
        shards=(bits.shape[0], S, K, D),
        compressors=ZstdCodec(level=1) if zstd else None,
        config={"write_empty_chunks": write_empty},
    )


def single(args: argparse.Namespace, work: Path) -> None:
    bits = make_bits(args.sequences)
    for write_empty in (False, True):
        for zstd in (True, False):
            best = float("inf")
            for _ in range(args.repeats):
                shutil.rmtree(work, ignore_errors=True)
                start = time.perf_counter()
                write(bits, work, zstd, write_empty)
                best = min(best, time.perf_counter() - start)
            record = {"write_empty_chunks": write_empty, "zstd1": zstd}
            print(json.dumps(record | {"GB_per_s": round(bits.nbytes / best / 1e9, 3)}))


def _process_writer(n: int, folder: Path, go: mp.Event, done: mp.Queue) -> None:
    bits = make_bits(n)  # made before the start signal: only the write is timed
    done.put("ready")
    go.wait()
    write(bits, folder)
    done.put("written")


def parallel(args: argparse.Namespace, work: Path) -> None:
    """N shards at once: from N threads of this process, then from N processes."""
    count, n = args.parallel, args.sequences
    total = count * make_bits(n).nbytes
    folders = [work / f"shard-{i}" for i in range(count)]
    bits = [make_bits(n) for _ in range(count)]
    shutil.rmtree(work, ignore_errors=True)
    threads = [
        threading.Thread(target=write, args=(b, f)) for b, f in zip(bits, folders, strict=True)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    print(json.dumps({"writers": f"{count} threads", "GB_per_s": round(total / seconds / 1e9, 3)}))
    del bits

    shutil.rmtree(work, ignore_errors=True)
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_process_writer, args=(n, f, go, done)) for f in folders]
    for proc in procs:
        proc.start()
    for _ in procs:
        done.get()
    start = time.perf_counter()
    go.set()
    for _ in procs:
        done.get()
    seconds = time.perf_counter() - start
    for proc in procs:
        proc.join()
    print(
        json.dumps({"writers": f"{count} processes", "GB_per_s": round(total / seconds / 1e9, 3)})
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--work", default="/tmp/zarr-write")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=0, help="N shards at once (0: one)")
    args = parser.parse_args()
    work = Path(args.work)
    if args.parallel:
        parallel(args, work)
    else:
        single(args, work)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
