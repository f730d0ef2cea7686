"""Benchmark: `dflash extract` on one GPU with a random-weight target of Qwen3-8B's shape.

Builds the target (bf16, random init) and a synthetic text dataset on local disk, then runs
(1) a bare forward of the base model over exactly the batches extraction will run (same
documents, same token-budget batching, no hooks, no LM head, no copies, no writes), then the
extraction's own forward (hooks, LM head, top-k, log-sum-exp) over them without copies or
writes, and (2) the real `run_extract` into a fresh store. Reports tokens/s of both and their ratio, bytes
per token on disk, the store's compression ratio, and peak GPU memory; (3) the disk's ceiling:
plain sequential writes of 4 GB to the same folder, fsync'd like a shard commit, to say
whether extraction is bound by the disk itself or by the write path above it; (4) the LM
head's per-chunk post-processing (argmax, top-k, log-sum-exp) eager vs compiled at the
configured chunk, ms per batch (bench/head_post.py; `--head-only` runs just that, in about a
minute, no target built). JSON lines to stdout and $OUT/bench_extract.jsonl.

    python bench/bench_extract.py [--tokens 300000] [--work /tmp/bench-extract] [--head-only]

`--build-only` builds the target and the data into --work on the CPU and stops (no GPU: one
tensor at a time, so an 8B-shaped target needs ~1.3 GB of memory, not 16 GB); `--num-layers N`
keeps the first N decoder layers (the features of layers below N do not depend on the rest).
bench/store_size.sh then measures the store's bytes per token on that target.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from head_post import time_head_post  # bench/ is on sys.path: scripts run as bench/x.py
from jsonl import emit_to
from shapes import QWEN3_8B

from common.config import build_config
from common.logging import init_logger
from common.store import HIDDEN_DTYPES, hidden_bytes_per_token
from common.tiny import build_tokenizer, example_texts
from stage1_extract.config import ExtractConfig
from stage1_extract.job import _batches, plan_job, tapped_target
from stage1_extract.packing import shard_pieces
from stage1_extract.run import run_extract
from stage1_extract.target import load_target


def disk_ceiling(folder: Path, total_bytes: int = 4 << 30, block: int = 64 << 20) -> dict:
    """GB/s of plain sequential writes of `total_bytes` into `folder`, fsync included."""
    data = os.urandom(block)
    path = folder / "disk-ceiling.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total_bytes // block):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return {
        "what": "disk_ceiling",
        "GB": total_bytes / 1e9,
        "GB_per_s": round(total_bytes / seconds / 1e9, 2),
    }


emit = emit_to("bench_extract.jsonl")


def build_target(folder: Path, shape: dict) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (folder / "config.json").is_file():
        return
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer(example_texts()).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    emit(
        {
            "what": "target_built",
            "params_B": round(params / 1e9, 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )


def build_target_cpu(folder: Path, shape: dict, shard_bytes: int = 2 << 30) -> None:
    """The same random target as build_target, one tensor at a time on the CPU: the model is
    laid out on the meta device and each weight drawn as transformers initializes a Qwen3
    (norms 1, every other weight N(0, initializer_range)), then written to safetensors shards."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (folder / "config.json").is_file():
        return
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, meta in model.state_dict().items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(meta.shape, dtype=torch.bfloat16)
            tensor.normal_(0.0, config.initializer_range, generator=generator)
        shard[name] = tensor
        total += tensor.numel() * tensor.element_size()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.save_pretrained(folder)
    build_tokenizer(example_texts()).save_pretrained(folder)
    emit(
        {
            "what": "target_built",
            "device": "cpu",
            "num_hidden_layers": config.num_hidden_layers,
            "params_B": round(total / 2 / 1e9, 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )


def build_data(path: Path, num_tokens: int) -> None:
    rng = random.Random(0)
    words = " ".join(example_texts()).split()
    with open(path, "w") as f:
        total = 0
        while total < num_tokens:
            n = rng.randint(200, 4000)  # words: ~2.5 tokens each with the tiny BPE (measured)
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
            total += n


def forward_ceilings(cfg: ExtractConfig) -> list[dict]:
    """Over the extraction's own batches: (1) the decoder alone, no hooks, LM head, copies or
    writes (the strictest yardstick: the extraction must also run the head); (2) the causal
    LM's own forward, decoder and LM head, logits returned (what `model(ids)` costs);
    (3) `TappedTarget.forward`, the extraction's compute (tapping hooks, LM head, top-k,
    log-sum-exp) without copies or writes. What (3) loses to (1) is compute; what the
    extraction loop loses to (3) is the IO path."""
    job = plan_job(cfg)
    model = load_target(cfg.target, torch.device("cuda:0"))
    base = model.get_decoder()
    target = tapped_target(job, model)
    batches = []
    for index in range(job.num_shards):
        pieces = shard_pieces(job.plan, index, cfg.store.sequences_per_shard)
        lengths = job.plan.length[pieces]
        for batch in _batches(lengths, cfg.run.batch_tokens):
            batches.append([int(lengths[j]) for j in batch])
    tokens = sum(sum(b) for b in batches)

    def bare(ids: torch.Tensor, _lengths: list[int], decoder: torch.nn.Module = base) -> None:
        # like the extractor: right-padded causal rows need no padding mask, and no KV cache
        decoder(input_ids=ids.cuda(non_blocking=True), use_cache=False)

    def causal_lm(ids: torch.Tensor, _lengths: list[int], lm: torch.nn.Module = model) -> None:
        lm(input_ids=ids.cuda(non_blocking=True), use_cache=False)

    records = []
    runs = (
        ("bare_forward", bare),
        ("causal_lm_forward", causal_lm),
        ("tapped_forward", target.forward),
    )
    for name, run in runs:
        with torch.inference_mode():
            for lengths in batches[:2]:  # warm-up
                run(torch.ones(len(lengths), lengths[0], dtype=torch.long), lengths)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for lengths in batches:
                run(torch.randint(0, 500, (len(lengths), lengths[0])), lengths)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        records.append(
            {
                "what": name,
                "tokens": tokens,
                "batches": len(batches),
                "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / seconds),
            }
        )
    records.append(profile_batches(target.forward, batches[:4]))
    del model, base, target
    torch.cuda.empty_cache()
    return records


def profile_batches(run: Any, batches: list[list[int]], top: int = 15) -> dict:
    """Where the GPU time of the extraction's forward goes: the `top` kernels by total CUDA
    time over these batches, in ms per batch (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU  # CPU: to try the script

    def spent(event: Any) -> float:
        return event.device_time_total if cuda else event.self_cpu_time_total

    with torch.inference_mode(), profile(activities=[activity]) as prof:
        for lengths in batches:
            run(torch.randint(0, 500, (len(lengths), lengths[0])), lengths)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=spent, reverse=True)
    per_batch = [
        {"kernel": e.key[:90], "ms": round(spent(e) / 1e3 / len(batches), 2)}
        for e in events
        if spent(e) > 0
    ]
    return {"what": "tapped_forward_profile", "batches": len(batches), "top": per_batch[:top]}


def loop_seconds(records: list[str]) -> float:
    """The extraction loop's own time, from run_extract's summary line (setup excluded)."""
    loop = [re.search(r"tokens in ([\d.]+) s", line) for line in records]
    return next((float(m.group(1)) for m in loop if m), float("nan"))


def writer_timeline(records: list[str]) -> dict:
    """The one-time costs of the loop, from the writers' debug timeline (DFLASH_LOG_LEVEL=DEBUG)
    and the summary line: start-up waits, the final drain, when the writers were ready."""

    def times(pattern: str) -> list[float]:
        return [float(m[1]) for r in records if (m := re.search(pattern, r))]

    loop_start = times(r"t=([\d.]+) s: target loaded")[0]
    first_commit = min(times(r"t=([\d.]+) s: shard \d+ committed"))
    waits = [
        (float(m[1]), float(m[2]))
        for r in records
        if (m := re.search(r"t=([\d.]+) s: waited ([\d.]+) s", r))
    ]
    return {
        "writers_ready_s": (times(r"ready after ([\d.]+) s")[:1] or [None])[0],
        "target_load_s": loop_start,
        "first_commit_after_loop_start_s": round(first_commit - loop_start, 2),
        "waited_before_first_commit_s": round(sum(w for t, w in waits if t - w <= first_commit), 2),
        "drain_s": times(r"drained in ([\d.]+) s")[0],
    }


def no_writes_loop(cfg: ExtractConfig, records: list[str], bare: dict, tapped: dict) -> dict:
    """run_extract with one writer thread whose shard write is a no-op (and no finalize)."""
    import stage1_extract.run as run_module
    import stage1_extract.writer_pools as pools

    cfg.run.writer_processes, cfg.run.writer_threads = 0, 1
    pools.write_shard = lambda *args: None  # type: ignore[assignment]
    run_module._finalize = lambda job: None  # type: ignore[assignment]
    run_extract(cfg)
    loop_s = loop_seconds(records)
    tokens = tapped["tokens"]
    return {
        "what": "extract_no_writes",
        "tokens": tokens,
        "loop_seconds": loop_s,
        "loop_tokens_per_s": round(tokens / loop_s),
        "ratio_to_bare_forward": round(tokens / loop_s / bare["tokens_per_s"], 3),
        "ratio_to_tapped_forward": round(tokens / loop_s / tapped["tokens_per_s"], 3),
        "peak_gpu_GB": round(torch.cuda.max_memory_allocated() / 1e9, 1),
        "hidden_dtype": cfg.store.hidden_dtype,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--tokens",
        type=int,
        default=300_000,
        help="words of synthetic text to extract (the tokenizer makes ~2.5 tokens of each)",
    )
    parser.add_argument("--work", default="/tmp/bench-extract")
    parser.add_argument("--writer-processes", type=int, default=4, help="0: writer threads")
    parser.add_argument("--writer-threads", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="keep the store (for bench_train)")
    parser.add_argument(
        "--also-no-writes",
        action="store_true",
        help="diagnostic, after the real run: the extraction loop again with writers that drop "
        "each shard (no zarr, no disk), to tell the cost of the copies and host work from that "
        "of the IO",
    )
    parser.add_argument("--hidden-dtype", default="bfloat16", choices=list(HIDDEN_DTYPES))
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="extra config key=value"
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=QWEN3_8B["num_hidden_layers"],
        help="decoder layers of the target (fewer: a truncated Qwen3-8B)",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="build the target (on the CPU) and the data into --work, then stop",
    )
    parser.add_argument(
        "--head-only",
        action="store_true",
        help="only part (4): the LM head's post-processing, eager vs compiled",
    )
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shape = {**QWEN3_8B, "num_hidden_layers": args.num_layers}
    if args.build_only:
        build_target_cpu(work / "target", shape)
        build_data(work / "data.jsonl", args.tokens)
        return
    store = work / "store"
    cfg = build_config(
        ExtractConfig,
        Path("configs/qwen3-8b.yaml"),
        "extract",
        [
            f"target.model={work / 'target'}",
            f"data.path={work / 'data.jsonl'}",
            f"store.out={store}",
            "run.devices=0",
            "store.sequences_per_shard=16",
            f"run.writer_processes={args.writer_processes}",
            f"run.writer_threads={args.writer_threads}",
            "run.progress=false",
            "store.overwrite=true",
            f"store.hidden_dtype={args.hidden_dtype}",
            *args.overrides,
        ],
    )
    # a batch's valid tokens: the budget less half a chunk, so it ends on a short chunk as
    # most batches do (the compiled tail graph is part of what is timed)
    chunk = cfg.verifier.head_chunk_tokens
    head_tokens = max(cfg.run.batch_tokens - chunk // 2, 1)
    emit(time_head_post(torch.device("cuda:0"), head_tokens, chunk, cfg.verifier.topk))
    if args.head_only:
        return
    build_target(work / "target", shape)
    build_data(work / "data.jsonl", args.tokens)
    emit(disk_ceiling(work))
    bare, causal_lm, tapped, profile = forward_ceilings(cfg)
    emit(profile)
    emit(bare)
    emit(
        {
            **causal_lm,
            "ratio_to_bare_forward": round(causal_lm["tokens_per_s"] / bare["tokens_per_s"], 3),
        }
    )
    emit(
        {**tapped, "ratio_to_bare_forward": round(tapped["tokens_per_s"] / bare["tokens_per_s"], 3)}
    )

    records: list[str] = []
    os.environ["DFLASH_LOG_LEVEL"] = "DEBUG"  # the writers' timeline, for writer_timeline
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    init_logger().addHandler(handler)
    # the bench's own folder: a run killed while deleting its store leaves a part of one
    shutil.rmtree(store, ignore_errors=True)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run_extract(cfg)
    seconds = time.perf_counter() - t0
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]["dflash"]
    tokens = attrs["counts"]["tokens"]
    on_disk = int(subprocess.check_output(["du", "-sb", str(store)]).split()[0])
    num_tapped = len(attrs["tapped_layers"])
    hidden_bytes = hidden_bytes_per_token(attrs["hidden_dtype"], num_tapped, attrs["hidden_size"])
    raw_per_token = hidden_bytes + attrs["topk"] * 8 + 21
    # the extraction loop's own time, from run_extract's summary line (setup excluded)
    loop_s = loop_seconds(records)
    waits = [re.search(r"waited ([\d.]+) s .* busy ([\d.]+) s per shard", line) for line in records]
    waited_s, write_s = next(((float(m[1]), float(m[2])) for m in waits if m), (None, None))
    timeline = writer_timeline(records)
    # one-time costs left out: the waits before the first commit (writers starting) and the
    # drain of the last shards; what a run of thousands of shards sees
    one_time_s = timeline["waited_before_first_commit_s"] + timeline["drain_s"]
    steady_tok_s = tokens / (loop_s - one_time_s)
    emit(
        {
            "what": "extract",
            "tokens": tokens,
            "seconds_total": round(seconds, 1),
            "tokens_per_s_total": round(tokens / seconds),
            "loop_seconds": loop_s,
            "loop_tokens_per_s": round(tokens / loop_s),
            "ratio_to_bare_forward": round(tokens / loop_s / bare["tokens_per_s"], 3),
            "ratio_to_tapped_forward": round(tokens / loop_s / tapped["tokens_per_s"], 3),
            "producer_waited_s": waited_s,
            **timeline,
            "ratio_to_bare_forward_steady": round(steady_tok_s / bare["tokens_per_s"], 3),
            "ratio_to_causal_lm_forward_steady": round(steady_tok_s / causal_lm["tokens_per_s"], 3),
            "writer_s_per_shard": write_s,
            "written_GB_per_s": round(on_disk / loop_s / 1e9, 2),
            "padding_share": round(
                attrs["counts"]["padding_tokens"] / (attrs["counts"]["padding_tokens"] + tokens),
                3,
            ),
            "bytes_per_token": round(on_disk / tokens),
            "raw_bytes_per_token": raw_per_token,
            "compression_ratio": round(raw_per_token * tokens / on_disk, 3),
            "peak_gpu_GB": round(torch.cuda.max_memory_allocated() / 1e9, 1),
            "store_GB": round(on_disk / 1e9, 2),
            "writer_processes": args.writer_processes,
            "writer_threads": args.writer_threads,
            "hidden_dtype": args.hidden_dtype,
            "overrides": args.overrides,
        }
    )
    if not args.keep:
        shutil.rmtree(store, ignore_errors=True)
    if args.also_no_writes:
        records.clear()
        torch.cuda.reset_peak_memory_stats()
        cfg.store.out = str(work / "store-no-writes")
        shutil.rmtree(cfg.store.out, ignore_errors=True)
        emit(no_writes_loop(cfg, records, bare, tapped))
        shutil.rmtree(cfg.store.out, ignore_errors=True)


if __name__ == "__main__":
    main()
