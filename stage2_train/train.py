"""`dflash train`: train the DFlash drafter from a store, data parallel over `run.devices`.

    dflash train --config configs/debug.yaml --store STORE --out RUN [--devices 0,1 | cpu]

`run_train` checks the store and the drafter config in the calling process (so mistakes fail
before any worker starts), then starts one process per device through
`common.distributed.launch` (torchrun's launcher; under `torchrun` it runs inline). Every worker
runs `train_worker`: DDP over the drafter, the store loader, AdamW + cosine schedule, held-out
evaluation, checkpoints in RUN/step-NNNNNN/ and the export in RUN/export/. Rerunning the same
command resumes from the newest checkpoint; on the CPU the resumed losses equal the
uninterrupted run's exactly.

Loss normalisation: the loss of an optimizer step is sum(w * CE) / sum(w) over every labelled
slot of every micro-batch of every rank (the denominator is all-reduced before the backward).
Padding items (see plan.py) have w = 0, so remainders are neither dropped nor duplicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm import tqdm

from common.distributed import (
    HeldFailure,
    WorkerContext,
    failure_shared,
    finish_worker,
    init_worker,
    launch,
    parse_devices,
)
from common.errors import report_to_launcher
from common.locks import exclusive_lock
from common.logging import get_logger, init_logger
from common.store import StoreError
from common.store_check import check_shards
from evaluation.chained import chained_tau_on_store, unstored_stop_ids
from evaluation.heldout import evaluate
from evaluation.offline import OfflineEvalConfig
from stage2_train.anchors import training_slot_weights
from stage2_train.batch import rounding_note
from stage2_train.best import BEST_DIR, BEST_FILE, best_record, best_so_far, dev_definition
from stage2_train.checkpoint import TrainState, save_checkpoint, step_dir
from stage2_train.config import TrainConfig, ignored_notes, with_compile_defaults
from stage2_train.data import StoreSequences, loader_arrays, make_loader
from stage2_train.export import export_drafter, served_copy, trained_for
from stage2_train.follow import (
    FollowHoldout,
    FollowPlan,
    WaitInterrupted,
    check_stream_position,
    wait_for_store,
)
from stage2_train.fp8 import check_fp8_installed, convert_to_fp8, plain_twin
from stage2_train.gc_schedule import ScheduledGC
from stage2_train.inputs import check_inputs, open_dev_store, trained_layers
from stage2_train.mask_token import mask_token_string
from stage2_train.metrics import MetricsWriter, check_finite_step, format_line, memory_gb
from stage2_train.model import DFlashDrafter
from stage2_train.plan import EpochPlan, HoldoutSampler, PlanSampler, split_store
from stage2_train.plots import draw_plots_safely
from stage2_train.prefetch import DevicePrefetcher
from stage2_train.resume import resume_run, say_nothing_to_train
from stage2_train.step import load_frozen_head
from stage2_train.stop import RANK_FAILED, TIME_LIMIT_EXIT, StopRequests, stopped
from stage2_train.time_fit import TimeFit, restore_fitted
from stage2_train.trackers import Trackers, check_trackers
from stage2_train.trainstep import (
    PendingStep,
    StepRunner,
    compute_context,
    packed_heads_per_group,
    replica_fingerprint,
    run_dtypes,
)

log = get_logger()
RUN_LOCK = ".train.lock"  # in the run folder, held while a `dflash train` writes it


def expand_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with `~` expanded in its paths, as extract and generate expand theirs: `--out=~/r`
    (a shell leaves `~` alone after `=`) would otherwise be a folder named `~` here."""
    home = lambda path: str(Path(path).expanduser()) if path else path  # noqa: E731
    data = dataclasses.replace(
        cfg.data, store=home(cfg.data.store), dev_store=home(cfg.data.dev_store)
    )
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, out=home(cfg.run.out)), data=data
    )


def run_train(cfg: TrainConfig) -> None:
    """Check inputs, then train on every device of `run.devices` (see the module docstring)."""
    cfg = expand_paths(cfg)
    for note in ignored_notes(cfg):  # a key the rest of the config leaves unused
        log.warning("%s", note)
    with contextlib.ExitStack() as held:
        if cfg.data.follow:  # extract may have just started: its store and first shard come later
            # the run folder is this run's before the wait: a second `--follow` run into it is
            # refused now, not once the store appears (minutes, or data.follow_timeout_s, later)
            held.enter_context(run_lock(Path(cfg.run.out)))
            waiting_since = time.monotonic()
            wait_for_store(cfg.data)
            cfg = limit_after_wait(cfg, time.monotonic() - waiting_since)
        info, _ = check_inputs(cfg)
        if info.complete:  # (--follow before completion: at each shard's and sequence's read)
            # a deleted or cut file (it reads as zeros) and a foreign or damaged shard's arrays
            # (its sizes agree with its own record), in every shard, in one error: now, not
            # each at its first read hours in. Under torchrun every rank checks alike (JSON and
            # stat only: ~1 ms a shard), before any process group or model exists
            check_shards(info, loader_arrays(info.hidden_dtype, cfg.loss.distill_weight > 0))
        if cfg.data.dev_store:  # now too, not once the model is built
            open_dev_store(cfg.data.dev_store, info, trained_layers(cfg, info))
        check_trackers(cfg.run.report_to)  # a missing package fails here, not in a worker
        check_fp8_installed(cfg.run.fp8_linear)
        devices = parse_devices(cfg.run.devices)
        if not cfg.data.follow:  # after the checks: a mistaken command makes no run folder
            held.enter_context(run_lock(Path(cfg.run.out)))
        launch(_worker, devices, cfg, devices)


def run_lock(out: Path) -> contextlib.AbstractContextManager:
    """One `dflash train` per run folder: a second one into the same --out would delete the
    first's checkpoint in the making and interleave its metrics. Held by the process that
    launches the ranks (under torchrun: global rank 0, whose node holds the run folder).
    Makes the folder."""
    out.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()

    def refused(holder: str) -> ValueError:
        return ValueError(
            f"--out {out}: another `dflash train` is writing this run ({holder}); wait for it "
            "to end, or pass another --out"
        )

    return exclusive_lock(out / RUN_LOCK, refused)


def limit_after_wait(cfg: TrainConfig, waited_s: float) -> TrainConfig:
    """`cfg` with the seconds --follow waited for the store taken off `run.time_limit_s`: the
    limit counts the training process's seconds (a job's wall clock), and the workers' clocks
    start after that wait, which lasts as long as extract takes to tokenize and load its
    target (minutes for a large one). A limit the wait used up leaves the workers one second:
    they stop after their first step, resumably."""
    limit = cfg.run.time_limit_s
    if limit is None or waited_s < 1.0:
        return cfg
    left = max(limit - waited_s, 1.0)
    log.info("waited %.0f s for the store: %.0f s left of run.time_limit_s", waited_s, left)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, time_limit_s=left))


# The process-group timeout (common/distributed.py; DFLASH_DIST_TIMEOUT_S overrides it). While
# rank 0 alone evaluates on the dev store, exports the best drafter, writes a checkpoint's model
# and optimizer, plots or exports at the end, the other ranks wait in the next all-reduce or
# barrier: minutes for a 1B-parameter drafter (~13 GB of checkpoint on a slow disk), past
# torch's 10 minutes for NCCL at worst. Two hours leave room for that and still end a hung run.
DIST_TIMEOUT = timedelta(hours=2)


def _worker(cfg: TrainConfig, devices: list[str]) -> None:
    init_logger()
    ctx = init_worker(devices, timeout=DIST_TIMEOUT)
    try:
        train_worker(cfg, ctx)
    finally:
        finish_worker()


@report_to_launcher  # inside _worker's try: it reports before the process group goes
def train_worker(cfg: TrainConfig, ctx: WorkerContext) -> None:
    """The training loop of one rank."""
    setting_up = time.perf_counter()
    info, shape = check_inputs(cfg)
    layers = trained_layers(cfg, info)  # data.tapped_layers, or every layer the store holds
    out = Path(cfg.run.out)
    param_dtype, compute_dtype = run_dtypes(cfg.run.dtype)
    device = ctx.device
    cfg = with_compile_defaults(cfg, on_gpu=device.type == "cuda")  # what checkpoints record
    head = load_frozen_head(cfg.data.store, device, compute_dtype)
    B = cfg.drafter.block_size
    slot_w_B = training_slot_weights(B, cfg.loss.weighting, cfg.loss.gamma).to(device)
    backend = "flex" if device.type == "cuda" and cfg.run.compile_attention else "sdpa"

    torch.manual_seed(cfg.run.seed)  # identical init on every rank (DDP also broadcasts it)
    model = DFlashDrafter(shape).to(device=device, dtype=param_dtype)
    if cfg.drafter.init_norm_from_target:  # a resumed run loads its own value over it
        with torch.no_grad():
            model.norm.weight.copy_(head.final_norm_D)
    # evaluations run the drafter as served (no fp8), through the same parameters
    served = model
    if cfg.run.fp8_linear is not None:  # swapped before compile and DDP see the layers
        b = cfg.optim.batch_sequences
        tokens = (b * info.seq_len, b * cfg.anchors.num_anchors * B)
        convert_to_fp8(model, cfg.run.fp8_linear, device, tokens)
        served = plain_twin(model)
    if cfg.run.compile_layers:  # Module.compile keeps the parameter names (no _orig_mod.)
        model.compile_layers(cuda_graphs=cfg.run.cuda_graphs)
    ddp = model
    if ctx.world_size > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )

    def dataset(target: str, distill: bool) -> StoreSequences:
        return StoreSequences(
            info,
            num_anchors=cfg.anchors.num_anchors,
            per_document=cfg.anchors.per_document,
            block_size=B,
            label_target=target,
            distill=distill,
            seed=cfg.data.seed,
            layers=layers,
        )

    distill = cfg.loss.distill_weight > 0
    pin = device.type == "cuda"
    flex_tables = backend == "flex"  # the loader builds them; the SDPA path reads none
    # run.pack_heads: the training batches' tables for B * R query rows a block (evaluations
    # run unpacked: their loader and the dev store's batches keep B)
    packed_rows = B * packed_heads_per_group(cfg, shape, backend)
    layout = (ctx.world_size, ctx.rank, cfg.optim.batch_sequences, cfg.optim.grad_accum)
    plan: EpochPlan | FollowPlan
    if cfg.data.follow:  # epoch 0 streams shards as extract commits them (follow.py)
        plan = FollowPlan(info, cfg.data, *layout)
        holdout: HoldoutSampler | FollowHoldout = FollowHoldout(plan, device)
    else:
        split = split_store(info, cfg.data.holdout_sequences)
        plan = EpochPlan(split.num_train, *layout, cfg.data.seed)
        holdout = HoldoutSampler(split, ctx.world_size, ctx.rank, cfg.optim.batch_sequences)
    sampler = PlanSampler(plan)
    loader = make_loader(
        dataset(cfg.loss.target, distill),
        sampler,
        cfg.data.num_workers,
        cfg.data.prefetch,
        pin,
        on_damaged=cfg.data.on_damaged,
        mask_tables=flex_tables,
        rows_per_block=packed_rows,
    )
    eval_loader = make_loader(
        dataset("argmax", False),
        holdout,
        0,
        cfg.data.prefetch,
        pin,
        cfg.data.on_damaged,
        mask_tables=flex_tables,
    )

    total_steps = plan.steps_per_epoch * cfg.optim.epochs
    if cfg.optim.max_steps is not None:
        total_steps = min(total_steps, cfg.optim.max_steps)
    runner = StepRunner(model, ddp, head, cfg, slot_w_B, backend, device, total_steps)
    config_dict = dataclasses.asdict(cfg)
    # the newest checkpoint that reads back whole, under the same (or an allowed) config
    state, saved_end = resume_run(
        cfg,
        ctx.world_size,
        info.attrs["content_key"],
        model=model,
        optimizer=runner.optimizer,
        scheduler=runner.scheduler,
        rank=ctx.rank,
        device=device,
        layers=layers,
        shape=dataclasses.asdict(shape),
        plan=plan,
    ) or (TrainState(step=0, epoch=0, step_in_epoch=0, stream=cfg.data.follow), None)
    check_stream_position(state, plan)
    # an end fitted to an earlier job's time limit holds on (time_fit.py)
    total_steps = restore_fitted(
        saved_end, runner.schedule_end, runner.scheduler, cfg.optim, total_steps
    )
    # rank 0 alone opens these (a damaged metrics.jsonl, a tracker that cannot start): each
    # section rank 0 does alone ends in failure_shared, so that the others stop with its error
    # rather than wait in their next collective until the process-group timeout
    with failure_shared():
        metrics = MetricsWriter(out / "metrics.jsonl", enabled=ctx.is_main, keep_until=state.step)
        trackers = Trackers(
            cfg.run.report_to if ctx.is_main else [],
            out,
            project=cfg.run.wandb_project,
            name=cfg.run.wandb_name,
            config=config_dict,
            resumed_step=state.step,
        )

    dev_info = None
    if cfg.data.dev_store:  # checked and announced by run_train before the launch
        dev_info = open_dev_store(cfg.data.dev_store, info, layers, announce=False)

    def run_dev_eval() -> dict[str, Any]:
        """Chained tau on data.dev_store (rank 0: the figure needs no other rank), computed the
        way `dflash evaluate` runs the export (bf16 weights computing in fp32, the target's head
        in fp32, eager layers), so that it is the online tau: run as trained (bf16 autocast, a
        bf16 head, compiled layers) it read 6.42 where the export's online tau over the same 11
        prompts was 6.59 (pystd, twelfth session)."""
        if dev_info is None or not ctx.is_main:
            return {}
        as_served = served_copy(served)
        head_fp32 = load_frozen_head(cfg.data.store, device, torch.float32)
        chained = chained_tau_on_store(
            as_served,
            head_fp32,
            dev_info,
            block_size=B,
            mask_token_id=shape.mask_token_id,
            backend=backend,
            chunk_tokens=OfflineEvalConfig.chunk_tokens,
            device=device,
            layers=layers,
        )
        del as_served, head_fp32
        return {"dev_chained_tau": chained["chained_tau"]}

    def run_eval() -> dict[str, Any]:
        batches = eval_loader
        data = cfg.data
        if data.hidden_as_fp8 or data.hidden_as_fp4 != "none":  # held out as trained
            batches = (
                batch.to(device).rounded_as_configured(data.hidden_as_fp8, data.hidden_as_fp4)
                for batch in eval_loader
            )
        with compute_context(cfg.run.dtype, device):
            return evaluate(
                served,
                head,
                batches,
                block_size=B,
                mask_token_id=shape.mask_token_id,
                backend=backend,
                slot_weights_B=slot_w_B,
                chunk_tokens=cfg.loss.head_chunk_tokens,
                device=device,
            )

    extra_meta = {
        "world_size": ctx.world_size,
        "store": str(info.path),
        "store_content_key": info.attrs["content_key"],
        "shape": dataclasses.asdict(shape),
        "target": {
            "tapped_layers": layers,
            "config": info.attrs["target"]["config"],
            "trained_for": trained_for(info.attrs),
        },
        # named for `dflash export`, which looks a null mask_token up again (the store may be gone)
        "tokenizer": {"name_or_path": info.attrs["tokenizer"].get("name_or_path")},
        # its string goes into the export's dflash_config (rank 0 writes meta and export)
        "mask_token": mask_token_string(info.attrs.get("tokenizer", {}), shape.mask_token_id)
        if ctx.is_main
        else None,
    }

    def export_to(folder: Path, fix: str, extra_files: dict[str, str] | None = None) -> Path:
        """The drafter as served (plain layers, the training parameters) into `folder`."""
        return export_drafter(
            served,
            shape,
            layers,
            info.attrs["target"]["config"],
            folder,
            mask_token=extra_meta["mask_token"],
            fix=fix,
            target=extra_meta["target"]["trained_for"],
            extra_files=extra_files,
        )

    # figures compare only on one dev store (data.dev_store may change on a resume) and under
    # one definition of the figure: best.py
    dev_key = dev_info.attrs["content_key"] if dev_info is not None else None
    definition = dev_definition(B, unstored_stop_ids(dev_info.attrs)) if dev_info else None
    best_tau = -math.inf
    if cfg.run.export_best and ctx.is_main and dev_info is not None:
        best_tau = best_so_far(out, cfg.data.dev_store, dev_key, definition)

    def export_if_best(record: dict[str, Any]) -> None:
        """run.export_best: export when this evaluation's dev_chained_tau beats the run's best."""
        nonlocal best_tau
        tau = record.get("dev_chained_tau")
        if not (cfg.run.export_best and ctx.is_main and tau is not None and tau > best_tau):
            return
        export_to(
            out / BEST_DIR,
            fix="free space, then rerun the same command (it resumes), or set "
            "run.export_best=false",
            extra_files={
                BEST_FILE: best_record(state.step, tau, cfg.data.dev_store, dev_key, definition)
            },
        )
        best_tau = tau
        record["best_exported"] = True

    def checkpoint() -> None:
        fingerprints = replica_fingerprint(model, ctx.world_size)
        if not all(map(math.isfinite, fingerprints)):  # NaN never equals itself: not a split
            raise ValueError(
                f"step {state.step}: the drafter's weights are not finite (NaN/Inf); nothing "
                "is saved: `dflash inspect verify` on the store, or a lower optim.lr"
            )
        if any(f != fingerprints[0] for f in fingerprints[::2]):
            raise RuntimeError(f"data-parallel replicas diverged: {fingerprints}")
        extra_meta["replica_fingerprints"] = fingerprints
        save_checkpoint(
            out,
            state,
            model=model,
            optimizer=runner.optimizer,
            scheduler=runner.scheduler,
            config=config_dict,
            rank=ctx.rank,
            keep=cfg.run.keep_checkpoints,
            extra_meta=extra_meta,
            fitted=runner.schedule_end.fitted,
        )

    log.info(
        "training %s: %s%d sequences (%d held out)%s, %d steps/epoch, %d steps, world %d, %s "
        "(set up in %.1f s)",
        shape,
        "up to " if cfg.data.follow else "",
        plan.num_train,
        cfg.data.holdout_sequences,
        # said where the run starts: its figures are an fp8 store's, from a bf16 one
        rounding_note(cfg.data.hidden_as_fp8, cfg.data.hidden_as_fp4),
        plan.steps_per_epoch,
        total_steps,
        ctx.world_size,
        backend,
        time.perf_counter() - setting_up,
    )
    if not cfg.data.follow and (note := plan.padding_note()):  # (follow's store grows)
        log.warning("%s", note)
    if state.step and state.step >= total_steps:  # only the export below
        say_nothing_to_train(out, state.step, total_steps)
    bar = tqdm(
        total=total_steps,
        initial=state.step,
        disable=not (ctx.is_main and cfg.run.progress),
        desc="train",
        dynamic_ncols=True,
    )
    batches = None
    prefetcher = DevicePrefetcher(device, cfg.optim.grad_accum)
    skipped_damaged = 0  # data.on_damaged=skip: sequences skipped by this run
    # SIGTERM, a first Ctrl-C or run.time_limit_s: finish the step, checkpoint, exit (stop.py);
    # the loader's workers ignore those signals, so they are stopped here however the loop ends
    stop = StopRequests(cfg.run.time_limit_s, device, ctx.world_size)
    # optim.fit_time_limit: the schedule moved to end, annealed, before that limit
    fit = TimeFit(
        cfg.optim,
        cfg.run.time_limit_s,
        total_steps,
        runner.scheduler,
        runner.schedule_end,
        first_step=state.step,
        device=device,
        world_size=ctx.world_size,
    )
    saved_step = state.step  # the newest checkpoint's (or 0)
    if isinstance(plan, FollowPlan) and ctx.world_size == 1:
        plan.watch.interrupt = stop.due  # stop while caught up with extraction, too

    # run.read_metrics_late: a step's metrics are read back once the next step is queued (the
    # line is written then; with several ranks the stop agreement too). `unread`: that step's
    # pending metrics, the loop's own fields and its start time
    late = cfg.run.read_metrics_late
    unread: tuple[PendingStep, dict[str, Any], float] | None = None

    def finish(
        pending: PendingStep, fields: dict[str, Any], started: float, ended: float | None = None
    ) -> dict[str, Any]:
        """The step's record: its metrics read back, the loop's fields, and its wall time from
        its start to `ended` (the next step's start, for a line read late; else now)."""
        nonlocal skipped_damaged
        record = pending.read()
        check_finite_step(record | fields, saved_step, cfg.data.store)
        state.tokens_seen += record.pop("labelled_tokens")
        skipped_damaged += record.get("skipped_damaged", 0)
        record.update(fields, mem_gb=memory_gb(device))
        # a step read late ends where the next began: counting to its read would count the
        # next step's loader wait and queueing twice (each step_s ~2x in the thirteenth session)
        end = time.perf_counter() if ended is None else ended
        record["step_s"] = round(end - started, 4)
        # the rest of step_s: queueing the step, waiting for the GPU, logging
        record["compute_s"] = round(record["step_s"] - record.pop("data_s"), 4)
        record["tokens_per_s"] = round(record["tokens"] / record["step_s"], 1)
        return record

    # a step's line, trackers and log are rank 0's alone: its error there is held (held.run)
    # and reaches the other ranks by the stop agreement, a checkpoint, an evaluation or the
    # end, which every rank meets anyway; raised at once, the others waited in the next
    # step's collectives until the process-group timeout
    held = HeldFailure(ctx.world_size)

    def write(record: dict[str, Any]) -> None:
        held.run(write_now, record)

    def write_now(record: dict[str, Any]) -> None:
        metrics.write(record)
        trackers.log(record)
        if ctx.is_main and ("eval_tau" in record or record["step"] == total_steps):
            draw_plots_safely(out)
        bar.update(1)
        step, logged = record["step"], cfg.run.log_every
        if ctx.is_main and (step % logged == 0 or step == total_steps or "eval_tau" in record):
            line = format_line(record, total_steps)
            if bar.disable:
                log.info(line)
            else:
                bar.write(line)

    def write_unread(ended: float | None = None) -> None:
        nonlocal unread
        if unread is not None:
            write(finish(*unread, ended))
            unread = None

    def keep_progress() -> None:
        """The steps trained so far into the metrics and a checkpoint (a stop, an error)."""
        write_unread()  # its tokens count into the checkpoint's state
        held.share()  # rank 0's line failed: no checkpoint without it, as with one rank
        if saved_step != state.step:
            checkpoint()

    def stop_now(code: int) -> NoReturn:
        keep_progress()
        bar.close()
        trackers.close()
        saved = str(step_dir(out, state.step)) if state.step else None
        raise stopped(code, state.step, total_steps, saved)

    with stop, contextlib.closing(loader), ScheduledGC(cfg.run.gc_every) as collector:
        while state.step < total_steps:
            try:
                if plan.epoch_done(state.epoch, state.step_in_epoch):  # --follow: may wait
                    state.epoch, state.step_in_epoch = state.epoch + 1, 0
                    if state.stream and state.epoch == 1:  # extract is done: a new pace
                        fit.restart_measuring(state.step)
                if batches is None:  # one iterator for the run: workers read on past epoch ends
                    sampler.set_position(state.epoch, state.step_in_epoch, total_steps - state.step)
                    batches = iter(loader)
                started = time.perf_counter()
                micro = prefetcher.take(batches)
                data_s = time.perf_counter() - started  # the wait for the loader
            except WaitInterrupted as interrupted:
                stop_now(interrupted.code)
            except StoreError:
                # --follow: extraction stopped (its timeout); the steps trained so far are
                # kept, as the error's rerun advice says (one rank: a checkpoint of several
                # gathers from all of them, which may not all have raised yet)
                if ctx.world_size == 1:
                    keep_progress()
                raise
            # the last step fetches nothing past the run; --follow's streamed epoch fetches in turn,
            # since its next batch may wait for extract (a step would wait with its metrics unsaved)
            streaming = state.stream and state.epoch == 0
            more = cfg.data.prefetch_to_device and state.step + 1 < total_steps and not streaming
            fetch = functools.partial(prefetcher.fetch, batches) if more else None
            pending = runner.queue(micro, fetch)
            fields: dict[str, Any] = {"data_s": data_s}
            state.step += 1
            state.step_in_epoch += 1
            if streaming:
                state.streamed_sequences = plan.streamed(state.step_in_epoch)
            fields.update(step=state.step, epoch=state.epoch)
            if (fitted := fit.observe(state.step)) is not None:  # the run now stops at its end
                total_steps = bar.total = fitted.end
                fields.update(schedule_end=fitted.end, decay_from=fitted.decay_from)
            if (gc_s := collector.after_step(state.step)) is not None:
                fields["gc_s"] = gc_s  # inside step_s: the loop's own time, counted
            write_unread(started)  # the previous step's: its kernels came before this step's
            last = state.step == total_steps
            due = (cfg.run.eval_every and state.step % cfg.run.eval_every == 0) or last
            every = cfg.run.checkpoint_every
            save = (every and state.step % every == 0) or last
            # a signal or the time limit (stop.py); also whether a rank holds a failure
            code = 0 if last else stop.due(late, failed=held.failed)
            if code == RANK_FAILED:
                held.share()  # raises on every rank, rank 0's error named
            if code == TIME_LIMIT_EXIT and fit.finish_at_limit(state.step):
                # the fitted decay is over: evaluate, checkpoint and export as at the end
                log.info(
                    "time limit: the fitted schedule ends at step %d, its lr annealed (%.2e); "
                    "the run is complete",
                    state.step,
                    runner.scheduler.get_last_lr()[0],
                )
                total_steps = bar.total = state.step
                last, due, save, code = True, True, True, 0
            if late and not (due or save or code or streaming):
                unread = (pending, fields, started)
                continue
            record = finish(pending, fields, started)
            if due and holdout.ready():  # --follow: once the held-out shards are committed
                record.update(run_eval())
            if due:
                with failure_shared():  # rank 0 alone; one collective per evaluation
                    held.raise_held()
                    record.update(run_dev_eval())
                    export_if_best(record)
                collector.after_step(state.step, evaluated=True)  # what the evaluations dropped
            write(record)
            if save:
                held.share()  # as in keep_progress (the last step always saves: its line too)
                checkpoint()
                saved_step = state.step
            if code:
                stop_now(code)
    bar.close()
    if skipped_damaged and ctx.is_main:
        log.warning(
            "skipped %d damaged sequences (data.on_damaged=skip; each named above): delete "
            "their shard folders and rerun the same `dflash extract` command to rebuild them",
            skipped_damaged,
        )
    with failure_shared():
        trackers.close()
        if ctx.is_main:
            path = export_to(
                out / "export",
                fix="free space, then rerun the same command (it only exports: the checkpoints "
                f"are whole), or `dflash export {out} --out FOLDER`",
            )
            log.info("exported the drafter of step %d to %s", state.step, path)
