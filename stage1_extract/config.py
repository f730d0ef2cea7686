"""Typed config of `dflash extract`; each component gets its own sub-config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config import doc


@dataclass
class TargetConfig:
    model: str = doc("", "target causal LM: local folder or hub id")
    revision: str | None = doc(
        None,
        "hub revision (branch, tag or commit); recorded in the store; unused for a local folder",
    )
    tokenizer: str | None = doc(None, "tokenizer folder or hub id; default: the model's")
    dtype: Literal["bfloat16", "float32"] = doc("bfloat16", "weights and activations dtype")
    attn_implementation: str = doc("sdpa", "transformers attention backend of the target")
    matmul_precision: Literal["highest", "high"] = doc(
        "highest",
        "float32 targets on GPUs: high runs their matmuls as TF32 (faster, ~1e-3 relative "
        "error, below the fp8 or bf16 the features are stored in); part of the store's key "
        "when on for a float32 target",
    )
    device_map: bool = doc(
        False,
        "split one large target across all --devices (one process) instead of one copy per GPU",
    )
    tapped_layers: list[int] | None = doc(
        None,
        "decoder layers whose outputs are stored (layer i = output of decoder layer i), in "
        "ascending order (servers concatenate them in forward order); "
        "default (null): num_tapped ids spread evenly (rounded) over 1..N-3 of the target's N "
        "layers, or over 0..N-2 when 1..N-3 holds fewer than num_tapped (small targets); one "
        "tapped layer: the middle of that range; the last layer, N-1, never by default; an "
        "error when 0..N-2 holds fewer than num_tapped",
    )
    num_tapped: int = doc(5, "how many layers to tap when tapped_layers is not given")
    trust_remote_code: bool = doc(False, "allow custom model code from the hub")

    def problems(self) -> list[str]:
        out = []
        if not self.model:
            out.append("model is required: a local folder or hub id (--model)")
        if self.num_tapped < 1:
            out.append(f"num_tapped must be >= 1, got {self.num_tapped}")
        if self.tapped_layers is not None and len(set(self.tapped_layers)) != len(
            self.tapped_layers
        ):
            out.append(f"tapped_layers has duplicates: {self.tapped_layers}")
        elif self.tapped_layers is not None and self.tapped_layers != sorted(self.tapped_layers):
            # servers (vLLM, SGLang) collect the layers in forward order and concatenate them
            # so: a drafter trained on another order would get its features permuted there
            out.append(
                f"tapped_layers {self.tapped_layers} is not in ascending order: list them as "
                f"{sorted(self.tapped_layers)} (servers concatenate them in forward order)"
            )
        if self.tapped_layers is not None and not self.tapped_layers:
            out.append(
                "tapped_layers is empty: list at least one layer id, or null for the default"
            )
        return out


@dataclass
class DataConfig:
    path: str = doc("", "dataset: local .json/.jsonl/.parquet file or folder, or a hub name")
    split: str = doc("train", "dataset split")
    name: str | None = doc(None, "hub dataset config name; unused for a local file or folder")
    format: Literal["auto", "messages", "sharegpt", "text", "completion"] = doc(
        "auto",
        "row shape: messages [{role, content}], sharegpt conversations [{from, value}], "
        "plain text, or completion (a `prompt` and a `completion` string: loss on the "
        "completion only); auto picks by column",
    )
    text_field: str = doc("text", "column holding plain text documents")
    prompt_field: str = doc("prompt", "completion rows: column holding the prompt text")
    completion_field: str = doc("completion", "completion rows: column holding the completion")
    messages_field: str | None = doc(None, "column holding the conversation; default by format")
    max_samples: int | None = doc(None, "use only the first N rows (null: all)")
    num_proc: int = doc(
        1, "processes tokenizing the dataset (datasets.map); the result is the same for any value"
    )
    on_invalid: Literal["error", "skip"] = doc(
        "error",
        "invalid rows (empty, no assistant turn, no loss token, or none in the first "
        "packing.seq_len under packing.overlong=truncate): stop with an error, or skip and "
        "count them in the store",
    )
    chat_template_kwargs: dict[str, Any] = doc(
        factory=dict,
        help="extra arguments to the chat template, e.g. {enable_thinking: false} for Qwen3; "
        "give `dflash generate` and `dflash extract` the same",
    )
    text_loss: Literal["all"] = doc("all", "plain text documents: every token is a loss token")

    def problems(self) -> list[str]:
        out = []
        if not self.path:
            out.append("path is required: a local file/folder or hub dataset (--data)")
        if self.num_proc < 1:
            out.append(f"num_proc must be >= 1, got {self.num_proc}")
        if self.max_samples is not None and self.max_samples < 1:
            out.append(f"max_samples must be >= 1, got {self.max_samples}")
        return out


@dataclass
class PackingConfig:
    seq_len: int = doc(3072, "tokens per packed sequence")
    overlong: Literal["split", "truncate"] = doc(
        "split", "documents longer than seq_len: split into seq_len pieces or keep the first piece"
    )
    strategy: Literal["best_fit", "next_fit"] = doc(
        "best_fit",
        "best_fit: each piece into the fullest open sequence that holds it (least padding); "
        "next_fit: into the current sequence, else a new one (dataset order kept)",
    )

    def problems(self) -> list[str]:
        return [] if self.seq_len >= 16 else [f"seq_len must be >= 16, got {self.seq_len}"]


@dataclass
class VerifierConfig:
    topk: int = doc(32, "top-k verifier logits stored per token (ids and values)")
    store_full_logits: bool = doc(False, "also store the full-vocabulary logits (bf16; huge)")
    head_chunk_tokens: int = doc(1024, "tokens per LM-head chunk (bounds the fp32 logits buffer)")
    compile_head: bool | None = doc(
        None,
        "each LM-head chunk's top-k, argmax and log-sum-exp as one torch.compile region: "
        "inductor fuses the fp32 log-sum-exp and the argmax into one pass over the bf16 logits "
        "(no fp32 [chunk, vocab] copy); topk and argmax as eager, log-sum-exp within fp32 "
        "rounding; two graphs (full chunks, the shorter last one) compiled on the first "
        "batches. Unset: on for a CUDA target (Qwen3-8B head shape on an H200: 16.5 vs 29.3 ms "
        "of post-processing per 11,776 tokens, the same argmax, top-k and log-sum-exp; "
        "BENCHMARKS.md), off on the CPU (inductor's C++ builds slow short runs). It compiles "
        "the features' fp8 or nvfp4 encoder too (the same bytes as eager on the CPU; nvfp4's "
        "eager encoder is ~200 passes over each tapped layer's features)",
    )

    def problems(self) -> list[str]:
        out = []
        if self.topk < 1:
            out.append(f"topk must be >= 1, got {self.topk}")
        if self.head_chunk_tokens < 1:
            out.append(f"head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        return out


@dataclass
class StoreConfig:
    out: str = doc("", "output store folder")
    sequences_per_shard: int = doc(64, "packed sequences per shard (one writer, one commit)")
    chunk_tokens: int = doc(1024, "tokens per Zarr chunk inside a shard (read granularity)")
    compression_level: int = doc(
        1,
        "zstd level (0 = no compression): 1..9 with store.byte_shuffle (Blosc's zstd levels), "
        "up to 22 without",
    )
    byte_shuffle: bool = doc(
        True,
        "byte-shuffle the float arrays of 2+ byte elements (bf16 hidden states, logits) before "
        "zstd, through Blosc: lossless, ~20% fewer bytes for a bf16 store (FORMAT.md)",
    )
    hidden_dtype: Literal["bfloat16", "float8_e4m3fn", "nvfp4"] = doc(
        "nvfp4",
        "dtype of the stored hidden states: nvfp4, 4-bit e2m1 values with an e4m3 scale per 16 "
        "and an fp32 one per token and tapped layer (0.56 bytes a feature, 0.62x an fp8 store's "
        "bytes on pystd-28m, 11.5 KB a token at the 8B width with five layers; a hidden size "
        "that is a multiple of 16; pystd online tau within 2% of an fp8 store's, 6.39 vs 6.42; "
        "extraction's loop at 8B 0.98x a bare forward against fp8's 0.96x: BENCHMARKS.md); "
        "float8_e4m3fn, one fp32 scale per token and tapped layer (the default before the "
        "forty-first session; 0.65x a bf16 store's bytes, its online tau 6.21 between two bf16 "
        "runs' 6.04 and 6.37); or bfloat16",
    )
    overwrite: bool = doc(False, "delete an existing store at `out` first")

    def problems(self) -> list[str]:
        out = []
        if not self.out:
            out.append("out is required: the store folder to write (--out)")
        if self.sequences_per_shard < 1:
            out.append(f"sequences_per_shard must be >= 1, got {self.sequences_per_shard}")
        if self.chunk_tokens < 1:
            out.append(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        # Blosc (the byte-shuffled arrays) takes levels 0..9 and zstd up to 22; past them the
        # first shard failed to encode, after the target loaded and the store was made
        if self.byte_shuffle and not 0 <= self.compression_level <= 9:
            out.append(
                f"compression_level must be 0..9 with byte_shuffle=true (Blosc's zstd levels), "
                f"got {self.compression_level}; lower it, or --set store.byte_shuffle=false "
                "for zstd's levels up to 22"
            )
        elif self.compression_level > 22:
            out.append(
                f"compression_level must be at most 22 (zstd's), got {self.compression_level}"
            )
        return out


@dataclass
class ExtractRunConfig:
    devices: str = doc("0,1", "GPU ids (one process each), or 'cpu'")
    batch_tokens: int = doc(
        16384,
        "token budget of one target forward (padded tokens); a document longer than it runs alone",
    )
    writer_processes: int = doc(
        4,
        "background processes writing shards; they encode in parallel (0: write from "
        "run.writer_threads threads of the extracting process, which share one interpreter)",
    )
    writer_threads: int = doc(2, "background writer threads when run.writer_processes=0")
    progress: bool = doc(True, "show a progress bar")

    def problems(self) -> list[str]:
        out = []
        if self.batch_tokens < 1:
            out.append(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if self.writer_processes < 0:
            out.append(f"writer_processes must be >= 0, got {self.writer_processes}")
        if self.writer_threads < 1:
            out.append(f"writer_threads must be >= 1, got {self.writer_threads}")
        return out


@dataclass
class ExtractConfig:
    target: TargetConfig = doc(factory=TargetConfig, help="the target model")
    data: DataConfig = doc(factory=DataConfig, help="the input dataset")
    packing: PackingConfig = doc(factory=PackingConfig, help="packing into fixed-length sequences")
    verifier: VerifierConfig = doc(factory=VerifierConfig, help="stored verifier logits")
    store: StoreConfig = doc(factory=StoreConfig, help="the output store")
    run: ExtractRunConfig = doc(factory=ExtractRunConfig, help="devices, batching, IO")
