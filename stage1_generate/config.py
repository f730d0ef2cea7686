"""Typed config of `dflash generate`; each component gets its own sub-config.

The data section is extract's own (`stage1_extract.config.DataConfig`): generate reads every
input extract reads, in the same row shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import doc
from stage1_extract.config import DataConfig, TargetConfig


@dataclass
class GenTargetConfig:
    model: str = doc("", "target causal LM: local folder or hub id (the local backend loads it)")
    revision: str | None = doc(
        None, "hub revision (branch, tag or commit); recorded; unused for a local folder"
    )
    tokenizer: str | None = doc(None, "tokenizer folder or hub id; default: the model's")
    dtype: Literal["bfloat16", "float32"] = doc(
        "bfloat16", "weights and activations dtype: generate in the dtype the target serves in"
    )
    attn_implementation: str = doc(
        "sdpa",
        "transformers attention backend of the target; sdpa_gqa_decode: sdpa with each decode "
        "step of grouped-query attention run on the key/value heads, no copy of the cache "
        "(stage1_generate/gqa_decode.py)",
    )
    matmul_precision: Literal["highest", "high"] = doc(
        "highest",
        "float32 targets on GPUs: high runs their matmuls as TF32 (faster; a near tie between "
        "two next tokens may then go the other way, so some replies change; recorded)",
    )
    trust_remote_code: bool = doc(False, "allow custom model code from the hub")

    def problems(self) -> list[str]:
        return [] if self.model else ["model is required: a local folder or hub id (--model)"]

    def as_target_config(self) -> TargetConfig:
        """The same settings as extract's target config, for its loaders."""
        return TargetConfig(
            model=self.model,
            revision=self.revision,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            matmul_precision=self.matmul_precision,
            trust_remote_code=self.trust_remote_code,
        )


@dataclass
class SamplingConfig:
    temperature: float = doc(0.0, "0: greedy (what a greedy-verified drafter must predict)")
    top_p: float = doc(1.0, "nucleus sampling mass when temperature > 0")
    top_k: int = doc(
        0,
        "when temperature > 0: sample from the k most likely tokens only, before top_p (0: "
        "all); e.g. Qwen3's served defaults are temperature 0.6, top_p 0.95, top_k 20",
    )
    repetition_penalty: float = doc(
        1.0,
        "above 1: the logit of each token already in the prompt or reply divided by it "
        "(multiplied when negative) before sampling, greedy included, as transformers and vLLM "
        "apply it (Qwen2.5-Instruct's generation_config.json sets 1.05); 1: none",
    )
    max_new_tokens: int = doc(
        1024,
        "longest reply per assistant turn (chat rows) or completion (completion rows; text "
        "rows: text.new_tokens); a prompt that with it exceeds the target's positions is an "
        "invalid row (too_long)",
    )
    seed: int = doc(0, "sampling seed; each chunk seeds seed + chunk index, so resumes agree")

    def problems(self) -> list[str]:
        out = []
        # NaN and inf (NaN passed `< 0` and failed in transformers after the target loaded; inf
        # sampled uniformly) are refused for every key by common.config.collect_problems
        if self.temperature < 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if self.repetition_penalty <= 0:
            out.append(f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # torch.manual_seed(seed + chunk) takes 64 bits: past them the first chunk failed after
        # the target loaded ("Overflow when unpacking long long")
        if not -(2**63) <= self.seed < 2**63:
            out.append(f"seed must be within [-2**63, 2**63), got {self.seed}")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TextWindowConfig:
    prompt_tokens: int = doc(256, "text rows: tokens of each window used as the prompt")
    new_tokens: int = doc(384, "text rows: tokens the target writes after each prompt")
    stride: int = doc(1024, "text rows: one window starts every `stride` tokens of a document")
    loss_on_prompt: bool = doc(
        True,
        "true: one `text` row per window (extract puts the loss on the prompt's dataset text "
        "too: measured better on pystd-28m, online tau 4.50 vs 3.89); false: {prompt, "
        "completion} rows, loss on the target's own tokens only",
    )
    stop_at_eos: bool = doc(
        True,
        "true: a reply ends at the target's end of sequence, as a server stops; false: the "
        "target writes all new_tokens, past its end of text as a base model does between "
        "concatenated documents (the row keeps that token's text, e.g. <|endoftext|>, which "
        "extract tokenizes back to its id): the text the shared harness's tau scores past a "
        "document's end (`dflash evaluate --no-stop-at-eos`)",
    )

    def problems(self) -> list[str]:
        return [
            f"{name} must be >= 1, got {value}"
            for name, value in vars(self).items()
            if type(value) is int and value < 1
        ]


@dataclass
class EndpointConfig:
    url: str | None = doc(
        None,
        "OpenAI-compatible server (`vllm serve`, SGLang), e.g. http://localhost:8000/v1; "
        "used when run.backend=openai",
    )
    model: str | None = doc(None, "model name the server serves; default: target.model")
    api_key_env: str = doc("OPENAI_API_KEY", "environment variable holding the API key, if any")
    concurrency: int = doc(64, "requests in flight at once")
    timeout_s: float = doc(600.0, "seconds one request may take")
    max_retries: int = doc(3, "retries of a failed request (connection errors, 5xx, 429)")

    def problems(self) -> list[str]:
        out = []
        if self.concurrency < 1:
            out.append(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            out.append(f"max_retries must be >= 0, got {self.max_retries}")
        # 0 made every request's socket non-blocking (BlockingIOError, retried as an overloaded
        # server), a negative one failed as "Timeout value out of range", naming no setting
        if not self.timeout_s > 0:
            out.append(f"timeout_s must be > 0, got {self.timeout_s}")
        return out


@dataclass
class OutputConfig:
    out: str = doc("", "output folder: part-*.jsonl.gz files that `dflash extract --data` reads")
    rows_per_chunk: int = doc(
        512, "source rows per output file: the unit of resume (a killed run redoes one chunk)"
    )
    overwrite: bool = doc(False, "delete an existing output folder at `out` first")

    def problems(self) -> list[str]:
        out = []
        if not self.out:
            out.append("out is required: the folder to write (--out)")
        if self.rows_per_chunk < 1:
            out.append(f"rows_per_chunk must be >= 1, got {self.rows_per_chunk}")
        return out


@dataclass
class GenerateRunConfig:
    devices: str = doc("0,1", "GPU ids (one process each, data parallel), or 'cpu'")
    backend: Literal["local", "openai"] = doc(
        "local",
        "local: transformers generate with a KV cache on --devices; openai: requests to "
        "endpoint.url (for targets too large for transformers' generate)",
    )
    batch_size: int = doc(256, "local backend: most prompts generated together")
    batch_tokens: int = doc(
        1_048_576,
        "local backend: most (prompt + new) tokens of one batch (bounds the KV cache); a row "
        "longer than it runs alone",
    )
    kv_cache: Literal["auto", "dynamic", "static", "preallocated"] = doc(
        "auto",
        "local backend: preallocated allocates each batch's KV cache at its final length and "
        "writes in place (the same replies as dynamic; 1.17x the new tokens/s on pystd-28m's "
        "real text, 1.19x at Qwen3-8B shape: BENCHMARKS.md); dynamic grows it each step "
        "(transformers concatenates, copying the whole cache every step); auto (the default) "
        "is preallocated where the target allows it (every layer full attention, no cache "
        "named by its generation_config) and dynamic, logged, where not; static preallocates "
        "it and, on a GPU, lets transformers compile the decode step (CUDA graphs; one compile "
        "per batch shape); a static cache is as long as the longest prompt + new tokens so "
        "far, and batch_tokens counts rows at that length",
    )
    progress: bool = doc(True, "show a progress bar")

    def problems(self) -> list[str]:
        out = []
        if self.batch_size < 1:
            out.append(f"batch_size must be >= 1, got {self.batch_size}")
        if self.batch_tokens < 1:
            out.append(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        return out


@dataclass
class GenerateConfig:
    target: GenTargetConfig = doc(factory=GenTargetConfig, help="the target model")
    data: DataConfig = doc(factory=DataConfig, help="the input dataset (as in extract)")
    sampling: SamplingConfig = doc(factory=SamplingConfig, help="how the target samples")
    text: TextWindowConfig = doc(factory=TextWindowConfig, help="continuation windows of text rows")
    endpoint: EndpointConfig = doc(factory=EndpointConfig, help="the openai backend's server")
    output: OutputConfig = doc(factory=OutputConfig, help="the output folder")
    run: GenerateRunConfig = doc(factory=GenerateRunConfig, help="devices, backend, batching")

    def problems(self) -> list[str]:
        if self.run.backend == "openai" and not self.endpoint.url:
            return ["run.backend=openai needs endpoint.url (e.g. http://localhost:8000/v1)"]
        return []
