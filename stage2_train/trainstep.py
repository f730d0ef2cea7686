"""One optimizer step: gradient accumulation over micro-batches, DDP, clipping, AdamW.

The step's loss is sum(w * (CE + distill_weight * KL)) / sum(w) over every labelled slot of all
micro-batches on all ranks. The denominator is all-reduced *before* the backward, from the
weights the loader already computed, so every micro-batch's gradient is scaled by the same
global constant: the result does not depend on how sequences are split over ranks and
micro-batches, and zero-weight padding items change nothing.

Legend: A anchors, B block size, Q = A*B query tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from stage2_train.config import TrainConfig
from stage2_train.data import Batch
from stage2_train.host_copy import HostCopy
from stage2_train.loss import chunked_block_loss
from stage2_train.model import DrafterShape
from stage2_train.schedule import ScheduleEnd, build_optimizer, build_scheduler
from stage2_train.step import FrozenHead, forward_batch


def _all_reduce(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value)
    return value


def run_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, compute dtype) of run.dtype; `mixed` keeps fp32 master weights."""
    if name == "mixed":
        return torch.float32, torch.bfloat16
    dtype = getattr(torch, name)
    return dtype, dtype


def compute_context(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for `mixed` (fp32 weights, bf16 matmuls); nothing otherwise."""
    if name != "mixed":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def packed_heads_per_group(cfg: TrainConfig, shape: DrafterShape, backend: str) -> int:
    """R, the query heads per key/value head that `run.pack_heads` folds into flex's rows
    (the training loader builds its tables for B * R rows a block); 1 when off or on SDPA."""
    if not cfg.run.pack_heads or backend != "flex":
        return 1
    return shape.num_attention_heads // shape.num_key_value_heads


class StepRunner:
    """Owns the optimizer and schedule; `step(micro_batches)` runs one optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        ddp: torch.nn.Module,
        head: FrozenHead,
        cfg: TrainConfig,
        slot_weights_B: torch.Tensor,
        backend: str,
        device: torch.device,
        total_steps: int,
    ) -> None:
        self.model, self.ddp, self.head, self.cfg = model, ddp, head, cfg
        self.slot_weights_B, self.backend, self.device = slot_weights_B, backend, device
        self.heads_per_group = packed_heads_per_group(cfg, model.shape, backend)
        self.cuda_graphs = bool(
            cfg.run.cuda_graphs and cfg.run.compile_layers and device.type == "cuda"
        )
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim, device)
        # where the decay ends: a time limit may move it earlier (time_fit.py)
        self.schedule_end = ScheduleEnd()
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps, self.schedule_end)

    def step(
        self, micro_batches: list[Batch], while_running: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Forward/backward every micro-batch, clip, update; returns the step's metrics (read
        back at once: the host waits for the GPU to finish the step); `compute_s` is the
        step's wall time from queueing to the metrics in hand."""
        started = time.perf_counter()
        record = self.queue(micro_batches, while_running).read()
        record["compute_s"] = round(time.perf_counter() - started, 4)
        return record

    def queue(
        self, micro_batches: list[Batch], while_running: Callable[[], None] | None = None
    ) -> PendingStep:
        """Queue one optimizer step (forward/backward every micro-batch, clip, update) and
        return its metrics unread: on a GPU they are copied to host memory behind the step's
        kernels, so the host can queue the next step before reading them (`PendingStep.read`).

        `while_running` is called once every kernel of the step is queued: work for the host
        that overlaps the step, like fetching the next batches (prefetch.DevicePrefetcher)."""
        started = time.perf_counter()
        if self.cuda_graphs:
            # a new step for the CUDA graphs' memory pool: the last step's graph outputs are
            # dead, so their memory may be reused (an evaluation between steps may have run)
            torch.compiler.cudagraph_mark_step_begin()
        B = self.cfg.drafter.block_size
        batches = [b.to(self.device) for b in micro_batches]
        data = self.cfg.data  # (the batches as they are when neither rounding is on)
        batches = [b.rounded_as_configured(data.hidden_as_fp8, data.hidden_as_fp4) for b in batches]
        weights = [b.weights_AB * self.slot_weights_B[None] for b in batches]
        local = torch.stack([w.sum() for w in weights]).sum().double()
        denom = _all_reduce(local.clone()).clamp(min=1e-12)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # ce, kl, weight, labelled
        correct_B = torch.zeros(B, dtype=torch.float64, device=self.device)
        total_B = torch.zeros(B, dtype=torch.float64, device=self.device)
        for i, (batch, weights_AB) in enumerate(zip(batches, weights, strict=True)):
            last = i == len(batches) - 1
            sync = (
                contextlib.nullcontext() if last or self.ddp is self.model else self.ddp.no_sync()
            )
            with sync, compute_context(self.cfg.run.dtype, self.device):
                hidden_QD = forward_batch(
                    self.ddp,
                    self.head,
                    batch,
                    block_size=B,
                    mask_token_id=self.model.shape.mask_token_id,
                    backend=self.backend,
                    heads_per_group=self.heads_per_group,
                )
                loss, stats = chunked_block_loss(
                    hidden_QD.to(self.head.lm_head_VD.dtype),  # fp32 -> bf16 under `mixed`
                    self.head.lm_head_VD,
                    batch.labels_AB,
                    weights_AB,
                    self.cfg.loss.head_chunk_tokens,
                    topk_ids_Qk=_flat(batch.topk_ids_ABk),
                    topk_logprobs_Qk=_flat(batch.topk_logprobs_ABk),
                    distill_weight=self.cfg.loss.distill_weight,
                    temperature=self.cfg.loss.distill_temperature,
                    dpace_alpha=(
                        self.cfg.loss.dpace_alpha if self.cfg.loss.weighting == "dpace" else 0.0
                    ),
                    compiled=self.cfg.loss.compile_chunks,
                )
                # loss is normalised by this micro-batch's weights: rescale to the global
                # denominator; DDP averages over ranks, hence the factor world.
                scale = stats["weight_sum"].double() * self.world / denom
                (loss * scale.to(loss.dtype)).backward()
            sums += torch.stack(
                [stats["ce_sum"], stats["distill_sum"], stats["weight_sum"], stats["total_B"].sum()]
            ).double()
            correct_B += stats["correct_B"].double()
            total_B += stats["total_B"].double()
        clip = self.cfg.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, clip if clip > 0 else float("inf"), foreach=True
        )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        fetch_s = None
        if while_running is not None:  # host time beside the queued kernels: reported alone
            fetch_started = time.perf_counter()
            while_running()
            fetch_s = round(time.perf_counter() - fetch_started, 4)

        # damaged sequences (data.on_damaged=skip) ride along: summed over ranks, read late
        damaged = sum(len(b.damaged) for b in micro_batches)
        damaged_1 = torch.full((1,), damaged, dtype=sums.dtype, device=self.device)
        packed = _all_reduce(torch.cat([sums, damaged_1, correct_B, total_B]))
        packed = torch.cat([packed, grad_norm.detach().double().reshape(1)])
        if self.world == 1:  # the loader's own (host) indices: nothing to wait for
            indices = torch.cat([b.indices.reshape(-1) for b in micro_batches]).long()
        else:
            indices = _gather_indices(torch.cat([b.indices for b in batches]), self.world)
        return PendingStep(
            packed,
            indices,
            world=self.world,
            host={
                "lr": lr,
                "tokens": sum(b.tokens_T.numel() for b in batches) * self.world,
                "queue_s": round(time.perf_counter() - started, 4),
                # (overlapped with the GPU's work on this step: it delays the step only by
                # what it outlasts that work)
                **({"fetch_s": fetch_s} if fetch_s is not None else {}),
            },
            block_size=B,
            distill_weight=self.cfg.loss.distill_weight,
        )


class PendingStep:
    """A queued step's metrics: `packed` (ce, kl, weight, labelled, damaged, correct_B, total_B,
    grad_norm) and the sequence indices start their copy to host memory behind the step's
    kernels; `read()` waits for that copy only, not for work queued after it."""

    def __init__(
        self,
        packed: torch.Tensor,
        indices: torch.Tensor,
        *,
        world: int,
        host: dict[str, Any],
        block_size: int,
        distill_weight: float,
    ) -> None:
        self.host, self.world = host, world
        self.block_size, self.distill_weight = block_size, distill_weight
        self.packed, self.indices = HostCopy(packed), HostCopy(indices)

    def read(self) -> dict[str, Any]:
        """The step's metrics (waits until the step's own kernels and copies are done)."""
        seqs = self.indices.read().reshape(self.world, -1).tolist()
        B = self.block_size
        values = self.packed.read().tolist()
        ce, kl, weight, labelled, damaged = values[:5]
        correct_B, total_B = values[5 : 5 + B], values[5 + B : 5 + 2 * B]
        acc_B = [c / max(n, 1) for c, n in zip(correct_B, total_B, strict=True)][1:]
        weight = max(weight, 1e-12)
        return {
            "loss": (ce + self.distill_weight * kl) / weight,
            "ce": ce / weight,
            **({"distill": kl / weight} if self.distill_weight > 0 else {}),
            "acc": [round(a, 4) for a in acc_B],
            "grad_norm": values[5 + 2 * B],
            "labelled_tokens": int(labelled),
            "seqs": seqs,
            # data.on_damaged=skip: sequences read as blank items this step, on every rank
            **({"skipped_damaged": int(damaged)} if damaged else {}),
            **self.host,  # lr, tokens, queue_s (and fetch_s)
        }


def _gather_indices(indices: torch.Tensor, world: int) -> torch.Tensor:
    """[world * n] sequence indices read this step, rank by rank (-1 = zero-weight padding
    item): an audit trail of the data order in metrics.jsonl, small next to the step's other
    numbers."""
    gathered = [torch.empty_like(indices) for _ in range(world)]
    dist.all_gather(gathered, indices)
    return torch.cat(gathered)


def replica_fingerprint(model: torch.nn.Module, world: int) -> list[float]:
    """sum and sum of squares of every parameter, per rank: DDP replicas must agree exactly."""
    params = [p.detach().double() for p in model.parameters()]
    local = torch.stack([sum(p.sum() for p in params), sum((p * p).sum() for p in params)])
    if world == 1:
        return local.tolist()
    local = local.to(params[0].device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return [v for g in gathered for v in g.tolist()]


def _flat(value: torch.Tensor | None) -> torch.Tensor | None:
    """[A, B, k] -> [Q, k] (rows in the same anchor-major order as the hidden states)."""
    return None if value is None else value.reshape(-1, value.shape[-1])
