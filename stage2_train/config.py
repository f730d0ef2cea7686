"""Typed config of `dflash train`; each component gets its own sub-config."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from common.config import doc

# drafter sizes that default to the target's
DRAFTER_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass
class DrafterConfig:
    num_layers: int = doc(5, "drafter decoder layers")
    block_size: int = doc(16, "slots per block: slot 0 = anchor token, slots 1.. = mask token")
    hidden_size: int | None = doc(None, "default: the target's hidden size (from the store)")
    intermediate_size: int | None = doc(None, "default: the target's")
    num_attention_heads: int | None = doc(None, "default: the target's")
    num_key_value_heads: int | None = doc(None, "default: the target's")
    head_dim: int | None = doc(None, "default: the target's")
    rope_theta: float | None = doc(
        None,
        "default: the target's (where its rope is set per layer type, e.g. Gemma 3, its "
        "full-attention layers': the drafter attends over the whole context)",
    )
    rms_norm_eps: float | None = doc(None, "default: the target's")
    mask_token_id: int | None = doc(
        None,
        "token id filling slots 1..B-1; default: the tokenizer's mask token, else the first "
        "embedding row past the tokenizer's vocabulary, else a mask-named or reserved special "
        "token, else the pad token; rows with a (near) zero embedding are skipped",
    )
    init_norm_from_target: bool = doc(
        True,
        "start the drafter's final norm at the target's final-norm weight, so the frozen LM "
        "head sees inputs at the scale it was trained on from step 0",
    )

    def problems(self) -> list[str]:
        out = []
        if self.num_layers < 1:
            out.append(f"num_layers must be >= 1, got {self.num_layers}")
        if self.block_size < 2:
            out.append(f"block_size must be >= 2, got {self.block_size}")
        # 0 read as unset (the target's) and a negative size failed in the model's build
        for name in DRAFTER_SIZES:
            value = getattr(self, name)
            if value is not None and value < 1:
                out.append(f"{name} must be >= 1 (or null: the target's), got {value}")
        for name in ("rope_theta", "rms_norm_eps"):  # <= 0: NaN at the first step
            value = getattr(self, name)
            if value is not None and value <= 0:
                out.append(f"{name} must be > 0 (or null: the target's), got {value}")
        if self.head_dim is not None and self.head_dim % 2:
            out.append(
                f"head_dim must be even (RoPE rotates pairs of features), got {self.head_dim}"
            )
        return out


@dataclass
class AnchorConfig:
    num_anchors: int = doc(512, "anchors sampled per packed sequence (among loss-mask positions)")
    per_document: bool = doc(
        False,
        "split the anchor budget across documents by their loss tokens, so short "
        "conversations are not starved",
    )

    def problems(self) -> list[str]:
        return (
            [] if self.num_anchors >= 1 else [f"num_anchors must be >= 1, got {self.num_anchors}"]
        )


@dataclass
class LossConfig:
    target: Literal["argmax", "data"] = doc(
        "argmax", "CE labels: the stored target argmax (any data) or the data tokens"
    )
    gamma: float | None = doc(
        None,
        "slot decay exp(-(k-1)/gamma) of weighting=decay; default 7 (B=16), 5 (B=10), 4 (B=8), "
        "else 7 * B / 16",
    )
    weighting: Literal["decay", "dpace"] = doc(
        "decay",
        "slot weights: decay = exp(-(k-1)/gamma) (the paper); dpace = D-PACE, per block "
        "sum_{m>=i} prod_{j<=m} q'_j with q' = (1-a) exp(-CE) + a (arXiv 2605.18810)",
    )
    dpace_alpha: float = doc(0.5, "D-PACE smoothing a, in (0, 1]")
    distill_weight: float = doc(0.0, "weight of the top-k KL distillation term (0 = off)")
    distill_temperature: float = doc(1.0, "temperature of the distillation term")
    head_chunk_tokens: int = doc(2048, "query tokens per LM-head + CE chunk")
    compile_chunks: bool | None = doc(
        None,
        "run each chunk's elementwise loss math (log-sum-exp, CE, top-k KL, D-PACE, softmax "
        "minus target, cast) as one torch.compile region, so inductor fuses its ~8-10 passes "
        "over the [chunk, vocab] logits; the LM-head matmuls stay cuBLAS calls; same loss up to "
        "fp32 rounding; one graph (two when query tokens % head_chunk_tokens != 0) compiled "
        "on the first step; null = on when training on GPUs (1.24x the step at the pystd "
        "shape, BENCHMARKS.md), off on the CPU",
    )

    def problems(self) -> list[str]:
        out = []
        if self.gamma is not None and self.gamma <= 0:
            out.append(f"gamma must be > 0, got {self.gamma}")
        if self.gamma is not None and self.weighting == "dpace":  # D-PACE's weights replace it
            out.append(
                f"gamma={self.gamma} sets the decay weighting's slot weights, which "
                "weighting=dpace replaces (it would be ignored): unset loss.gamma (null), or "
                "set loss.weighting=decay"
            )
        if not 0 < self.dpace_alpha <= 1:
            out.append(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.distill_weight < 0:
            out.append(f"distill_weight must be >= 0, got {self.distill_weight}")
        if self.distill_temperature <= 0:  # 0: NaN at step 1; < 0: the targets' order inverted
            out.append(
                f"distill_temperature must be > 0 (1: the target's own distribution), got "
                f"{self.distill_temperature}"
            )
        if self.head_chunk_tokens < 1:
            out.append(f"head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        return out


@dataclass
class OptimConfig:
    lr: float = doc(6e-4, "peak learning rate (AdamW)")
    weight_decay: float = doc(
        0.0, "AdamW weight decay of the weight matrices (the RMSNorm weights never decay)"
    )
    betas: list[float] = doc(factory=lambda: [0.9, 0.95], help="AdamW betas")
    warmup_ratio: float = doc(0.04, "share of steps with linear warmup")
    min_lr_ratio: float = doc(0.0, "the schedule's floor as a share of lr")
    schedule: Literal["cosine", "wsd"] = doc(
        "cosine",
        "lr after warmup: cosine decay to the floor, or wsd (warmup-stable-decay): the peak lr, "
        "then a 1 - sqrt decay to the floor over the last decay_ratio of the steps",
    )
    decay_ratio: float = doc(0.2, "wsd: share of the steps after warmup spent decaying")
    fit_time_limit: bool = doc(
        True,
        "with run.time_limit_s: when the measured step rate says the limit comes before "
        "the last step, end the schedule at the last step that fits and stop there, annealed, "
        "instead of at the limit mid-schedule. wsd: its decay moved there, decided once, when "
        "it begins (already decaying: the rest of it re-mapped onto the steps left from the "
        "current lr); cosine: the rest of the cosine re-mapped onto the steps left from the "
        "current lr, at the first projection that falls short, again after a slowdown, and "
        "later again (up to the configured end) early on when the steps turn out faster. "
        "Kept by checkpoints (stage2_train/time_fit.py)",
    )
    grad_clip: float = doc(1.0, "max global gradient norm (0 = off)")
    epochs: int = doc(6, "passes over the training sequences")
    max_steps: int | None = doc(
        None,
        "stop after this many optimizer steps, or after optim.epochs where that comes first "
        "(null: all epochs); the schedule spans the steps run",
    )
    batch_sequences: int = doc(1, "packed sequences per micro-batch per rank")
    grad_accum: int = doc(1, "micro-batches per optimizer step")

    def problems(self) -> list[str]:
        out = []
        if self.lr <= 0:
            out.append(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            out.append(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:  # < 0: a negative lr at the end (gradient ascent)
            out.append(
                f"min_lr_ratio must be in [0, 1] (the floor as a share of the peak lr), got "
                f"{self.min_lr_ratio}"
            )
        if not 0 < self.decay_ratio <= 1:
            out.append(f"decay_ratio must be in (0, 1], got {self.decay_ratio}")
        # AdamW's own refusal came after the model was built, naming neither key nor fix
        if self.weight_decay < 0:
            out.append(f"weight_decay must be >= 0 (0: off), got {self.weight_decay}")
        if len(self.betas) != 2:
            out.append(f"betas must have two values, got {self.betas}")
        elif not all(0 <= beta < 1 for beta in self.betas):
            out.append(f"betas must each be in [0, 1) (e.g. [0.9, 0.95]), got {self.betas}")
        if self.grad_clip < 0:  # was taken as off, as 0 is
            out.append(f"grad_clip must be >= 0 (0: off), got {self.grad_clip}")
        if self.max_steps is not None and self.max_steps < 1:
            out.append(f"max_steps must be >= 1 (or null: all epochs), got {self.max_steps}")
        if self.epochs < 1:
            out.append(f"epochs must be >= 1, got {self.epochs}")
        for name in ("batch_sequences", "grad_accum"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, got {getattr(self, name)}")
        return out


@dataclass
class TrainDataConfig:
    store: str = doc("", "store folder written by `dflash extract`")
    holdout_sequences: int = doc(8, "sequences held out (from the end) for evaluation")
    num_workers: int = doc(2, "loader worker processes")
    prefetch: int = doc(4, "batches prefetched per worker")
    prefetch_to_device: bool = doc(
        False,
        "fetch the next step's batches and start their copy to the GPU while a step runs "
        "(a side stream), instead of after its metrics are read back (stage2_train/prefetch.py;"
        " off until a GPU has passed bench/prefetch_check.py and measured the gain)",
    )
    seed: int = doc(0, "seed of shuffling and anchor sampling")
    hidden_as_fp8: bool = doc(
        False,
        "train and evaluate held-out on a bf16 store's hidden states rounded as an fp8 store "
        "(store.hidden_dtype=float8_e4m3fn) holds them: one scale per token and layer, then the "
        "fp8 path's decode. What the fp8 store costs in acceptance, measured from one bf16 store "
        "on the same text and held-out sequences (the dev store keeps its own dtype); nothing "
        "changes on an fp8 store",
    )
    hidden_as_fp4: Literal["none", "mxfp4", "nvfp4"] = doc(
        "none",
        "train and evaluate held-out on the store's hidden states rounded to 4 bits (e2m1) as a "
        "store of such features would hold them: mxfp4, a power-of-two scale per 32 features "
        "(0.53 bytes a feature), or nvfp4, an e4m3 scale per 16 under an fp32 one per token and "
        "layer (0.56); fp8 takes 1 (common/fp4.py). What such a store would cost "
        "in acceptance, measured before it exists; the dev store and served drafters see the "
        "features unrounded",
    )
    tapped_layers: list[int] | None = doc(
        None,
        "train on these of the store's tapped layers (target layer ids in ascending order, "
        "each one the store holds; null: all of them). The drafter, its export and its "
        "evaluations read only these: what fewer layers cost in acceptance, measured from one "
        "store on the same text and held-out sequences (the dev store must hold them too)",
    )
    on_damaged: Literal["error", "skip"] = doc(
        "error",
        "a sequence whose stored bytes do not decode or whose file is missing or cut: stop "
        "with an error naming its shard and array, or skip it (logged, counted in metrics)",
    )
    follow: bool = doc(
        False,
        "train while `dflash extract` writes the store (--follow): epoch 0 reads the shards in "
        "store order as they are committed, later epochs shuffle the complete store; each "
        "epoch counts num_shards x sequences_per_shard - holdout_sequences sequences in the "
        "schedule (stage2_train/follow.py)",
    )
    dev_store: str | None = doc(
        None,
        "a store of the target's own continuation of your online prompts (`dflash generate` "
        "with {prompt, completion} rows, then `dflash extract --set store.hidden_dtype="
        "bfloat16`: a server feeds unrounded features): every evaluation logs "
        "dev_chained_tau on it, the online tau computed from the store (README); checked at "
        "the start: a store of the training store's target and tokenizer, holding the tapped "
        "layers the drafter reads",
    )
    follow_poll_s: float = doc(
        2.0, "--follow: seconds between looks for the next shard (a directory listing each)"
    )
    follow_timeout_s: float = doc(
        1800.0,
        "--follow: stop with an error after this many seconds without a new shard while no "
        "`dflash extract` holds the store's writer lock",
    )

    def problems(self) -> list[str]:
        out = []
        if not self.store:
            out.append("store is required: the folder `dflash extract` wrote (--store)")
        if self.holdout_sequences < 0:
            out.append(f"holdout_sequences must be >= 0 (0: none), got {self.holdout_sequences}")
        if self.num_workers < 0:
            out.append(
                f"num_workers must be >= 0 (0: load in the training process), got "
                f"{self.num_workers}"
            )
        if self.num_workers > 0 and self.prefetch < 1:  # without workers the loader ignores it
            out.append(
                f"prefetch must be >= 1 with num_workers > 0 (batches each loader worker keeps "
                f"ready), got {self.prefetch}: raise data.prefetch, or set data.num_workers=0 to "
                "load batches in the training process"
            )
        for name in ("follow_poll_s", "follow_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_as_fp8 and self.hidden_as_fp4 != "none":
            out.append(
                f"hidden_as_fp8 and hidden_as_fp4={self.hidden_as_fp4} both round the features: "
                "set one of them (hidden_as_fp4=none, or hidden_as_fp8=false)"
            )
        layers = self.tapped_layers
        if layers is not None and list(layers) != sorted(set(layers)):
            # the export's target_layer_ids: servers concatenate the layers in forward order
            out.append(
                f"tapped_layers {list(layers)} must be distinct and ascending: list them as "
                f"{sorted(set(layers))} (servers concatenate the drafter's layers in forward order)"
            )
        return out


@dataclass
class TrainRunConfig:
    out: str = doc("", "run folder: checkpoints, metrics.jsonl, export/")
    export_best: bool = doc(
        True,
        "with data.dev_store: export the drafter at its best dev_chained_tau so far to "
        "RUN/export-best/ (best.json: step, figure and the dev store it was measured on) as "
        "training reaches it; export/ stays the final drafter",
    )
    devices: str = doc("2,3", "GPU ids for data parallel (one process each), or 'cpu'")
    dtype: Literal["bfloat16", "float32", "mixed"] = doc(
        "mixed",
        "bfloat16: bf16 parameters, AdamW states and compute; float32: all fp32; mixed: fp32 "
        "parameters and AdamW states (master weights), bf16 compute under autocast",
    )
    compile_attention: bool = doc(
        True,
        "GPUs: the anchor-block attention as flex_attention compiled as its own region; false "
        "runs the dense SDPA path instead, which materialises the Q x KV mask (small shapes, "
        "debugging); the CPU always runs the SDPA path (flex has no backward there)",
    )
    pack_heads: bool = doc(
        False,
        "flex attention (GPUs) with the query heads of each key/value group folded into the "
        "kernel's rows: a 64-row tile then holds one anchor block of 16 queries x 4 heads, "
        "whose context is one interval instead of the union of four anchors' (at the seed "
        "shape 1.17-1.21x fewer key tiles visited, 2.7-3.1x fewer partial ones); the same "
        "output (CPU tests against the dense reference). Slower on an H200 (BENCHMARKS.md, "
        "twenty-first session, 'GQA-packed attention': bench/bench_attention.py --sweep --only "
        "gqa_packed, seed shape, fwd+bwd): 0.68x the unpacked region's speed with 128-row "
        "tiles (the kernel alone 1.09x faster, the copies folding heads into rows and back "
        "costing more) and 0.38x with 64-row ones; hence off. Evaluations run unpacked",
    )
    compile_layers: bool | None = doc(
        None,
        "also torch.compile each drafter layer (fixed shapes, attention stays its own region): "
        "fuses norms, RoPE and the MLP; costs a longer first step; null = on when training on "
        "GPUs (with loss.compile_chunks 1.54x the step at the pystd shape, BENCHMARKS.md), off "
        "on the CPU",
    )
    cuda_graphs: bool = doc(
        False,
        "with run.compile_layers: compile the layers in torch.compile's reduce-overhead mode, "
        "whose graphs replay as CUDA graphs (fewer kernel launches on the host; the step is "
        "~90% GPU-busy at the pystd shape, so at most ~10%); the flex attention region and the "
        "loss chunks stay as they are; inputs the graphs do not own (each layer's context "
        "features, RoPE tables, the attention's output) are copied into their buffers at every "
        "replay; no effect on the CPU; measured slower on an H200 at the pystd shape (73.0 vs "
        "69.0 ms a step, every graph replayed: BENCHMARKS.md), so off "
        "(bench/profile_train_step.py --set run.cuda_graphs=true)",
    )
    fp8_linear: Literal["tensorwise", "rowwise"] | None = doc(
        None,
        "fp8 matmuls in the drafter's linear layers (torchao float8 training, pip install "
        "'dflash-offline[fp8]'; a GPU of compute capability >= 8.9, best with "
        "run.compile_layers=true, which fuses the casts; emulated on the CPU, for tests): "
        "tensorwise = one scale per tensor, rowwise = one per row; weights, checkpoints, "
        "evaluations and the export are those of a run without it; null = off (measured on "
        "an H200, BENCHMARKS.md: tensorwise 0.87x the bf16 step at the Qwen3-8B drafter "
        "shape, 1.18x at pystd's 384 width; rowwise 1.04x at 8B; acceptance unmeasured)",
    )
    gc_every: int = doc(
        50,
        "Python's automatic garbage collection is off while training; generations 0-1 are "
        "collected every gc_every steps on all ranks at once (a full pass after evaluations), "
        "so no rank stalls a step at a moment of CPython's choosing (stage2_train/"
        "gc_schedule.py); the time goes to the step's gc_s metric; 0 = CPython's own schedule",
    )
    read_metrics_late: bool = doc(
        True,
        "queue step s+1 before reading step s's metrics back, so the host's work between "
        "steps (the next batch, logging) overlaps the GPU's; metrics.jsonl and the log get "
        "each step's line one step later (at once at evaluations, checkpoints and the end); "
        "with several GPUs the ranks' stop agreement is read late too (a stop request takes "
        "effect one step later)",
    )
    log_every: int = doc(10, "steps between log lines")
    eval_every: int = doc(500, "steps between held-out evaluations (0 = only at the end)")
    checkpoint_every: int = doc(1000, "steps between checkpoints (0 = only at the end)")
    keep_checkpoints: int = doc(2, "newest checkpoints kept")
    time_limit_s: float | None = doc(
        None,
        "stop after the step that passes this many seconds of the training loop, with a "
        "checkpoint (exit code 124; rerun to resume): a job's wall-clock limit, less the "
        "start-up before the loop (store checks, model build, resume; a --follow wait for the "
        "store counts) and the final evaluation, checkpoint and export after it. SIGTERM and a "
        "first Ctrl-C stop the same way (exit 143 / 130); null = no limit",
    )
    seed: int = doc(0, "seed of model init")
    progress: bool = doc(True, "show a progress bar")
    report_to: list[Literal["tensorboard", "wandb"]] = doc(
        factory=list,
        help="trackers that also get every step's and evaluation's metrics, beside "
        "metrics.jsonl: tensorboard (event files in RUN/tensorboard), wandb (offline unless "
        "WANDB_MODE says otherwise; RUN/wandb); pip install 'dflash-offline[track]'",
    )
    wandb_project: str = doc("dflash-offline", "W&B project of the run (report_to: wandb)")
    wandb_name: str | None = doc(None, "W&B run name; default: the run folder's name")
    allow_config_change: bool = doc(
        False,
        "on a resume, apply the fields that differ from the checkpoint's config (lr, schedule, "
        "steps, loss, anchors; each logged) instead of refusing; the drafter and the data "
        "layout can never change (--allow-config-change)",
    )

    def problems(self) -> list[str]:
        out = []
        if not self.out:
            out.append("out is required: the run folder (--out)")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            out.append(f"time_limit_s must be > 0 (or null for none), got {self.time_limit_s}")
        if self.keep_checkpoints < 1:
            out.append(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.log_every < 1:
            out.append(f"log_every must be >= 1, got {self.log_every}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}")
        if self.gc_every < 0:
            out.append(f"gc_every must be >= 0 (0: CPython's own schedule), got {self.gc_every}")
        if len(set(self.report_to)) != len(self.report_to):
            out.append(f"report_to lists a tracker twice: {self.report_to}")
        if self.cuda_graphs and self.compile_layers is False:
            out.append(
                "cuda_graphs replays the compiled layers: it needs compile_layers (set "
                "run.compile_layers=true, or leave it null: on for GPUs)"
            )
        return out


@dataclass
class TrainConfig:
    drafter: DrafterConfig = doc(factory=DrafterConfig, help="drafter architecture")
    anchors: AnchorConfig = doc(factory=AnchorConfig, help="anchor sampling")
    loss: LossConfig = doc(factory=LossConfig, help="training loss")
    optim: OptimConfig = doc(factory=OptimConfig, help="optimizer and schedule")
    data: TrainDataConfig = doc(factory=TrainDataConfig, help="the store and loader")
    run: TrainRunConfig = doc(factory=TrainRunConfig, help="devices, logging, checkpoints")


def with_compile_defaults(cfg: TrainConfig, on_gpu: bool) -> TrainConfig:
    """`cfg` with run.compile_layers and loss.compile_chunks decided where the config left them
    null: on for a GPU run, where they were measured (BENCHMARKS.md, eighth session), off on the
    CPU, where nothing was measured and inductor's C++ builds slow short runs and tests."""
    layers = cfg.run.compile_layers
    chunks = cfg.loss.compile_chunks
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, compile_layers=on_gpu if layers is None else layers),
        loss=dataclasses.replace(cfg.loss, compile_chunks=on_gpu if chunks is None else chunks),
    )


def _on_cpu(cfg: TrainConfig) -> bool:
    return {d.strip() for d in cfg.run.devices.split(",")} == {"cpu"}


_NO_FOLLOW = (
    "data.follow=false reads a complete store, waiting for no shard; pass --follow "
    "(data.follow=true) for it to apply"
)
_NO_WANDB = "run.report_to lists no wandb; set run.report_to=[wandb] for it to apply"
# (key, when the rest of the config leaves it unused, why and the fix); a key's first row that
# holds is the one reported, so the CPU rows come first (their fix is the one that applies).
# Set together on purpose these stay legal: a warning, never a refusal.
IGNORED: tuple[tuple[str, Callable[[TrainConfig], bool], str], ...] = (
    (
        "run.pack_heads",
        _on_cpu,
        "run.devices=cpu runs the SDPA attention (flex has no backward on the CPU), which "
        "packs no heads; train on GPUs for it to apply",
    ),
    (
        "run.pack_heads",
        lambda c: not c.run.compile_attention,
        "run.compile_attention=false runs the SDPA attention, which packs no heads; set "
        "run.compile_attention=true for it to apply",
    ),
    (
        "run.cuda_graphs",
        _on_cpu,
        "run.devices=cpu has no CUDA graphs; train on GPUs for it to apply",
    ),
    (
        "optim.decay_ratio",
        lambda c: c.optim.schedule == "cosine",
        "optim.schedule=cosine decays over every step after warmup (decay_ratio is wsd's); set "
        "optim.schedule=wsd for it to apply",
    ),
    (
        "loss.dpace_alpha",
        lambda c: c.loss.weighting == "decay",
        "loss.weighting=decay weighs the slots by loss.gamma (dpace_alpha is D-PACE's); set "
        "loss.weighting=dpace for it to apply",
    ),
    (
        "loss.distill_temperature",
        lambda c: c.loss.distill_weight == 0,
        "loss.distill_weight=0 turns the distillation term off; set loss.distill_weight > 0 "
        "(e.g. 0.5) for it to apply",
    ),
    (
        "data.prefetch",
        lambda c: c.data.num_workers == 0,
        "data.num_workers=0 loads batches in the training process, with no worker to "
        "prefetch; set data.num_workers > 0 for it to apply",
    ),
    ("data.follow_poll_s", lambda c: not c.data.follow, _NO_FOLLOW),
    ("data.follow_timeout_s", lambda c: not c.data.follow, _NO_FOLLOW),
    ("run.wandb_project", lambda c: "wandb" not in c.run.report_to, _NO_WANDB),
    ("run.wandb_name", lambda c: "wandb" not in c.run.report_to, _NO_WANDB),
)


def ignored_notes(cfg: TrainConfig) -> list[str]:
    """One warning per key of IGNORED set off its default where the rest of `cfg` leaves it
    unused: a value that would otherwise train exactly as the default does, without a word."""
    default = TrainConfig()
    notes: list[str] = []
    warned: set[str] = set()
    for key, unused, why in IGNORED:
        value = functools.reduce(getattr, key.split("."), cfg)
        was = functools.reduce(getattr, key.split("."), default)
        if key in warned or value == was or not unused(cfg):
            continue
        warned.add(key)
        notes.append(
            f"{key}={_as_set(value)} is ignored: {why}, or drop {key} (default {_as_set(was)})"
        )
    return notes


def _as_set(value: object) -> str:
    """`value` as --set takes it (true, null), where str() writes Python's (True, None)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)
