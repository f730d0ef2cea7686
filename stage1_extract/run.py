"""`dflash extract`: run the target once over a dataset and write the store of FORMAT.md.

    dflash extract --config configs/qwen3-8b.yaml --data convs.jsonl --out /data/store
    dflash extract --config configs/debug.yaml --model M --data D --out S --devices cpu

Flow: every process plans identically (tokenize via a cached `datasets` map, pack with the
deterministic plan); the store root is prepared once (created, or checked for resuming); each
process loads the target and fills the shards `i % world == rank` that are not committed yet;
once all exist the root gets its counts and `complete: true`. Rerunning the same command
resumes. A rank that fails stops the others at their next shard: torchrun's ranks through
`another_rank_failed` (they meet in failure_shared, which raises its error on every rank; one
interrupted by Ctrl-C leaves at once, and the others end `stopped` without meeting it), a
local launch's processes through the launcher, which ends the others as soon as one exits.
Within a shard the documents are run alone (positions from 0), sorted by length and batched to
`run.batch_tokens` padded tokens, and their outputs are scattered into the packed layout by
non-blocking copies into pinned buffers that background threads write to disk.

Legend: B batch rows, T padded length, N valid tokens of a batch, M = n * S token slots of a
shard, K tapped layers, D hidden size.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path

from tqdm import tqdm

from common.distributed import (
    WorkerContext,
    another_rank_failed,
    failure_shared,
    finish_worker,
    gather_from_all_ranks,
    init_worker,
    launch,
    parse_devices,
    under_torchrun,
)
from common.logging import get_logger, init_logger
from common.store import HEAD_FILE, committed_shards
from common.target_config import text_config
from stage1_extract.config import ExtractConfig
from stage1_extract.host_buffers import BufferShape, ShardBuffers, available_memory_bytes
from stage1_extract.job import ExtractJob, fill_shard, plan_job, tapped_target
from stage1_extract.packing import padding_hint
from stage1_extract.shard_writer import ShardWriter
from stage1_extract.store_root import finalize_store, prepare_store, writer_lock
from stage1_extract.target import load_target, save_target_head
from stage1_extract.writer import ShardLayout
from stage1_extract.writer_pools import LockWatch


def _extract_shards(
    job: ExtractJob, ctx: WorkerContext, devices: list[str], watch: LockWatch | None
) -> None:
    """Fill and write this process's uncommitted shards (and the head file on rank 0).
    `watch`: the store's lock where another process took it for this run (None: this one)."""
    log, cfg = get_logger(), job.cfg
    # Where another process holds the store's lock (a local launch's launcher), the head file is
    # committed as this process's shards are: only while that holder still holds it. A killed
    # launcher's rank 0 must not rename its target's head into a store that a rerun (perhaps
    # of another target) now writes: that rerun, finding a head file, would keep it.
    head_check = None if watch is None else watch.check
    done = set(committed_shards(job.store))
    todo = [i for i in range(job.num_shards) if i % ctx.world_size == ctx.rank and i not in done]
    need_head = ctx.is_main and not (job.store / HEAD_FILE).is_file()
    if not todo and not need_head:
        return
    if not todo:
        model = load_target(cfg.target, ctx.device, devices)
        save_target_head(model, job.store / HEAD_FILE, head_check)
        return
    shape = buffer_shape(job)
    # the writers start before the target loads, so their start-up overlaps the load
    writer = ShardWriter(
        job.store,
        ShardLayout(
            cfg.packing.seq_len,
            cfg.store.chunk_tokens,
            cfg.store.compression_level,
            cfg.store.byte_shuffle,
        ),
        cfg.run.writer_processes,
        cfg.run.writer_threads,
        len(todo),
        job.shard_bytes,
        lambda: ShardBuffers.allocate(shape, pin=ctx.device.type == "cuda"),
        watch,
    )
    try:
        loading = time.perf_counter()
        model = load_target(cfg.target, ctx.device, devices)
        log.info("rank %d: target loaded in %.1f s", ctx.rank, time.perf_counter() - loading)
        assert model.get_output_embeddings().out_features == job.vocab_size
        if need_head:
            save_target_head(model, job.store / HEAD_FILE, head_check)
        target = tapped_target(job, model)
    except BaseException:
        _close_writer(writer)
        raise
    total = sum(job.shard_tokens(i) for i in todo)
    bar = tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        dynamic_ncols=True,
        desc=f"extract (rank {ctx.rank}/{ctx.world_size}, {len(todo)} shards)",
        disable=not (cfg.run.progress and ctx.is_main),
    )
    log.debug("t=%.2f s: target loaded, the first shard starts", writer.clock())
    start, filled, tokens = time.perf_counter(), 0, 0
    try:
        for index in todo:
            if another_rank_failed():  # its error ends this rank too, where the ranks meet
                break
            writer.submit(fill_shard(job, target, index, writer.acquire(), bar.update))
            filled, tokens = filled + 1, tokens + job.shard_tokens(index)
    finally:
        _close_writer(writer)
        bar.close()
    seconds = time.perf_counter() - start
    ready = writer.ready_after_s
    log.info(
        "rank %d: %d shards, %d tokens in %.1f s (%.0f tokens/s, writes included); waited "
        "%.1f s for a free buffer; writers busy %.1f s per shard, ready after %s (started "
        "before the target load), the last shards drained in %.1f s",
        ctx.rank,
        filled,
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
        writer.waited_s,
        writer.write_s / max(filled, 1),
        "?" if ready is None else f"{ready:.1f} s",
        writer.drain_s,
    )


def _close_writer(writer: ShardWriter) -> None:
    """Let the writers commit the shards they hold. Interrupted (a second Ctrl-C), stop them
    from committing before `_worker` releases the store's lock: writer threads hold no copy of
    it, and a rerun taking it could otherwise scan the store while one renames a shard in."""
    try:
        writer.close()
    except BaseException:
        writer.pool.stop()
        raise


def buffer_shape(job: ExtractJob) -> BufferShape:
    cfg = job.cfg
    return BufferShape(
        slots=cfg.store.sequences_per_shard * cfg.packing.seq_len,
        num_tapped=len(job.tapped),
        hidden_size=job.hidden_size,
        topk=cfg.verifier.topk,
        vocab=job.vocab_size if cfg.verifier.store_full_logits else None,
        hidden_dtype=cfg.store.hidden_dtype,
    )


def check_host_memory(job: ExtractJob, local_processes: int) -> None:
    """Refuse, before anything is loaded, shard buffers that would not fit in host memory: the
    out-of-memory killer would otherwise end the run mid-way without a word."""
    available = available_memory_bytes()
    if available is None:
        return
    run = job.cfg.run
    writers = run.writer_processes or run.writer_threads
    shards_each = -(-job.num_shards // local_processes)
    buffers = min(writers, shards_each) + 1
    arena = buffer_shape(job).offsets()[1]
    need = local_processes * buffers * arena
    if need > 0.9 * available:
        raise ValueError(
            f"extracting to {job.store} needs {need / 2**30:.1f} GiB of host memory for shard "
            f"buffers ({local_processes} process(es) x {buffers} buffers (writers + 1) x "
            f"{arena / 2**30:.2f} GiB), but {available / 2**30:.1f} GiB is available; lower "
            "store.sequences_per_shard, or run.writer_processes / run.writer_threads"
        )


# Ranks wait at barriers while rank 0 tokenizes (minutes; about an hour per billion tokens)
# and while the slowest rank extracts its last shards (up to one rank's whole share on a resume
# where the others have nothing left: hours). The process-group timeout (torch's NCCL default:
# 10 minutes) must outlast both; DFLASH_DIST_TIMEOUT_S overrides it (common/distributed.py).
BARRIER_TIMEOUT = timedelta(hours=48)


def _worker(
    cfg: ExtractConfig,
    devices: list[str],
    error_dir: str | None,
    launcher_lock: str | None,
    model_name: str = "target.model",
) -> None:
    """One process. `launcher_lock`: what the launcher wrote into the store's lock file, where
    it took the lock, prepared the store and will finalize it; None: rank 0 does all three.
    `model_name`: how the user gave the target (--model or target.model), for its errors."""
    init_logger()
    ctx = init_worker(devices, timeout=BARRIER_TIMEOUT)
    lock = ExitStack()  # rank 0 holds the store's writer lock for the whole run
    try:
        if launcher_lock is not None:
            job, holder = plan_job(cfg, model_name), launcher_lock
        elif ctx.is_main:  # rank 0 first: it fills the datasets cache the others then reuse
            # (its failure stops every rank at once, not at the process-group timeout)
            with failure_shared():
                job = _plan_and_say(cfg, model_name)
                _warn_padding(job)
                _warn_logit_transform(job)
                check_host_memory(job, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                holder = lock.enter_context(writer_lock(job.store))
                prepare_store(job.store, job.attrs, cfg.store.overwrite, job.key_parts)
            gather_from_all_ranks(holder)  # hands the others `holder`
        else:
            with failure_shared():  # rank 0's preparation
                pass
            # Rank 0's holder text comes from its memory, not from the lock file read after a
            # barrier: rank 0 killed just after it, a rerun could take the lock before this rank
            # (busy, or on another host) read the file, and the watch would guard the rerun
            holder = gather_from_all_ranks(None)[0]
            job = plan_job(cfg, model_name)
        with nullcontext() if launcher_lock is not None else failure_shared():
            _extract_shards(job, ctx, devices, LockWatch.of(job.store, holder))
        if launcher_lock is None:
            with failure_shared():  # the others leave once the store is marked complete
                if ctx.is_main:
                    _finalize(job)
    except ValueError as err:
        if error_dir is not None:
            Path(error_dir, f"rank-{ctx.rank}.txt").write_text(str(err))
        raise
    finally:
        lock.close()
        finish_worker()


def _plan_and_say(cfg: ExtractConfig, model_name: str) -> ExtractJob:
    """`plan_job`, and a line with what it read and how long it took: on generated data the
    tokenizing is most of the minute a run spends before its first forward."""
    start = time.perf_counter()
    job = plan_job(cfg, model_name)
    get_logger().info(
        "prepared %d rows: %d documents, %d tokens, packed as %d pieces into %d sequences of "
        "%d, %d shards (%.1f s: read, tokenized, packed)",
        job.prepared.num_rows,
        len(job.lengths),
        int(job.lengths.sum()),
        job.plan.num_pieces,
        job.plan.num_sequences,
        cfg.packing.seq_len,
        job.num_shards,
        time.perf_counter() - start,
    )
    return job


def _warn_padding(job: ExtractJob) -> None:
    """Say so before any GPU work when a seq_len near packing.seq_len would pad far less."""
    packing = job.cfg.packing
    if hint := padding_hint(job.lengths, job.plan, packing.overlong, packing.strategy):
        get_logger().warning(hint)


# config fields of models whose forward transforms the LM head's logits after it
POST_HEAD_TRANSFORMS = ("logits_scaling", "logit_scale", "final_logit_softcapping")


def _warn_logit_transform(job: ExtractJob) -> None:
    """Say so when the target's forward transforms the head's logits (FORMAT.md: the store
    keeps the raw ones; argmax and top-k ids are the target's either way)."""
    config = text_config(job.attrs["target"]["config"])
    found = {
        k: v for k in POST_HEAD_TRANSFORMS if (v := getattr(config, k, None)) not in (None, 1, 1.0)
    }
    if found:
        get_logger().warning(
            "the target transforms its logits after the LM head (%s): topk_logits and "
            "logsumexp are stored raw (FORMAT.md); argmax and top-k ids are its own",
            ", ".join(f"{k}={v}" for k, v in found.items()),
        )


def _finalize(job: ExtractJob) -> None:
    final = finalize_store(job.store, job.attrs, job.source_documents, job.prepared.skipped)
    counts = final["counts"]
    get_logger().info(
        "store %s complete: %d shards, %d sequences, %d documents, %d tokens (%d loss), %d "
        "padding; skipped: %s",
        job.store,
        final["num_shards"],
        counts["sequences"],
        counts["documents"],
        counts["tokens"],
        counts["loss_tokens"],
        counts["padding_tokens"],
        # rows skipped by reason, and assistant turns kept without loss (empty_assistant_turn)
        ", ".join(f"{k} {v}" for k, v in sorted(job.prepared.skipped.items())) or "none",
    )


def run_extract(cfg: ExtractConfig, model_name: str = "target.model") -> None:
    """Extract (or resume extracting) the store `cfg.store.out`; ValueError on bad input.
    `model_name`: how the user gave the target, named in its errors: `--model` when the flag
    set it, else the config key."""
    devices = parse_devices(cfg.run.devices)
    if cfg.target.device_map and devices[0] == "cpu":
        raise ValueError("target.device_map=true needs GPUs in run.devices, e.g. 0,1")
    procs = 1 if cfg.target.device_map else len(devices)
    if procs == 1 or under_torchrun():
        _worker(cfg, devices, None, None, model_name)
        return
    # several local processes: validate and prepare here, so user errors stay ValueErrors
    job = _plan_and_say(cfg, model_name)
    _warn_padding(job)
    _warn_logit_transform(job)
    check_host_memory(job, procs)
    # this process holds the writer lock for its ranks, which never take it: they are handed
    # what it wrote into the lock file, and commit only while the file still names it
    with writer_lock(job.store) as holder:
        prepare_store(job.store, job.attrs, cfg.store.overwrite, job.key_parts)
        with tempfile.TemporaryDirectory(prefix="dflash-extract-") as error_dir:
            try:
                launch(_worker, devices, cfg, devices, error_dir, holder, model_name)
            except Exception as err:
                messages = sorted(Path(error_dir).glob("rank-*.txt"))
                if messages:
                    raise ValueError("; ".join(p.read_text() for p in messages)) from err
                raise
        _finalize(job)
