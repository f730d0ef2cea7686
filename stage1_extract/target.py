"""The target model during extraction: loading, tapping decoder layers, and the chunked LM head.

`load_target_config` checks the target before anything heavy happens (a missing folder or an
unreachable hub id is a ValueError naming the fix); `resolve_tapped_layers` turns the config's
layer choice into ids; `TappedTarget` runs the base model (no full-vocabulary logits) with
forward hooks that keep only the tapped layers' outputs (bf16, or fp8 with a scale per token and
layer), then applies the LM head in chunks and keeps per token the argmax, the top-k and the
log-sum-exp of the full row (stage1_extract/head_stats.py; compiled on GPUs).

Legend: B batch rows, T padded length, N valid (non-padding) tokens of a batch, K tapped
layers, D hidden size, V vocabulary, k top-k, C tokens of one LM-head chunk.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from common.config import runs_tf32
from common.durable import fsync_path
from common.store import HIDDEN_DTYPES, encode_hidden, hidden_row_width
from common.target_config import text_config
from stage1_extract.config import TargetConfig
from stage1_extract.head_stats import head_chunk_stats
from stage1_extract.store_root import is_local


def _looks_local(name: str) -> bool:
    """A path rather than a hub id ("org/name" has one slash)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1


def load_target_config(cfg: TargetConfig, name: str = "target.model") -> PretrainedConfig:
    """The target's transformers config; ValueError naming the model and the fix when absent.
    `name` is the input as the user gave it: the config key, or a command's flag (--model,
    --target)."""
    path = Path(cfg.model)
    if path.exists() and not (path / "config.json").is_file():
        raise ValueError(
            f"{name} {cfg.model}: folder has no config.json; pass the folder that "
            "save_pretrained wrote (config.json + weights) or a hub id"
        )
    if not path.exists() and _looks_local(cfg.model):
        raise ValueError(
            f"{name} {cfg.model}: no such folder; pass an existing model folder "
            "(config.json + weights) or a hub id like Qwen/Qwen3-8B"
        )
    try:
        return AutoConfig.from_pretrained(
            cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:
        # target.revision is a config key: offered where the target came from the config or a
        # revision was set (evaluate and convert have neither)
        revision = ", target.revision" if name == "target.model" or cfg.revision else ""
        raise ValueError(
            f"{name} {cfg.model}: cannot load its config ({err}); pass an existing model "
            f"folder or a reachable hub id (check the name{revision}, network/HF_HUB_OFFLINE)"
        ) from err


# config attributes holding the positions a model was trained for, by the names configs give
# them (transformers maps most onto max_position_embeddings, e.g. GPT-2's n_positions)
MAX_POSITION_NAMES = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
)


class MaxPositions(NamedTuple):
    limit: int
    source: str  # what gives it, for messages: "max_position_embeddings" or the rope scaling


def max_positions(config: PretrainedConfig | dict[str, Any]) -> MaxPositions | None:
    """The most positions a sequence may use on the target, or None when its config names none.

    Past them a rotary model runs on without an error, at positions it was not trained on
    (RoPE extrapolation): its hidden states and logits there are out of distribution. The
    limit is the config's max_position_embeddings (or the same under another name), raised by
    rope scaling as transformers applies it: factor x original_max_position_embeddings, the
    original defaulting to max_position_embeddings itself. A config whose
    max_position_embeddings already is the scaled length (Llama 3.1: 131072, factor 8 x 8192)
    keeps it, and so does Gemma 3's, scaled already (131072, its 128K context, under linear
    scaling x8 that has no original length: vLLM skips its factor the same way). `config` is a
    transformers config or the stored JSON dict; a multimodal target's limit is its decoder's
    (`text_config`, nested as an object or a dict)."""
    text = text_config(config)
    named = [(n, getattr(text, n, None)) for n in MAX_POSITION_NAMES]
    named = [(n, v) for n, v in named if type(v) is int and v > 0]  # not None, nor a bool
    if not named:
        return None
    found = MaxPositions(named[0][1], named[0][0])
    # Gemma 3 (any of its model types): its limit is scaled already (above)
    outer = (
        config.get("model_type")
        if isinstance(config, dict)
        else getattr(config, "model_type", None)
    )
    if any("gemma3" in str(kind) for kind in (outer, getattr(text, "model_type", None))):
        return found
    # transformers 5 keeps rope scaling in rope_parameters (from config.json's rope_scaling
    # too), earlier versions in rope_scaling; nested by layer type on some models
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(rope, dict):
        return found
    nested = not {"rope_type", "type", "factor"} & rope.keys()
    for params in [p for p in rope.values() if isinstance(p, dict)] if nested else [rope]:
        kind = params.get("rope_type", params.get("type", "default"))
        factor = params.get("factor")
        if kind == "default" or type(factor) not in (int, float) or factor <= 1:
            continue
        original = params.get("original_max_position_embeddings") or getattr(
            text, "original_max_position_embeddings", None
        )
        scaled = int(factor * (original or found.limit))
        if scaled > found.limit:
            found = MaxPositions(scaled, f"positions under {kind} rope scaling x{factor:g}")
    return found


def target_revision(config: PretrainedConfig, cfg: TargetConfig) -> str | None:
    """The hub commit when transformers resolved one, else the revision asked for of a hub id,
    else None: a local folder is read as it is, whatever target.revision says."""
    commit = getattr(config, "_commit_hash", None)
    return commit or (None if is_local(cfg.model) else cfg.revision)


def config_dict(config: PretrainedConfig) -> dict[str, Any]:
    """JSON-safe full config, without the version stamp (it does not decide the content)."""
    out = json.loads(config.to_json_string(use_diff=False))
    out.pop("transformers_version", None)
    return out


def resolve_tapped_layers(cfg: TargetConfig, num_layers: int) -> list[int]:
    """Explicit `tapped_layers`, checked, or `num_tapped` ids spread evenly over 1..N-3 (0..N-2
    when 1..N-3 holds too few; one id: the middle of the range; N-1 never by default)."""
    if cfg.tapped_layers is not None:
        bad = [i for i in cfg.tapped_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"target.tapped_layers {bad} out of range: {cfg.model} has {num_layers} decoder "
                f"layers (ids 0..{num_layers - 1}); fix target.tapped_layers or leave it null "
                "to spread target.num_tapped layers evenly"
            )
        return list(cfg.tapped_layers)
    # the paper's range is 1..N-3; small targets fall back to 0..N-2 (the last layer's output
    # is what the final norm and the head already see, so it is never a default)
    for first, last in ((1, num_layers - 3), (0, num_layers - 2)):
        if last - first + 1 >= cfg.num_tapped:
            break
    else:
        raise ValueError(
            f"target.num_tapped={cfg.num_tapped} does not fit {cfg.model}: it has {num_layers} "
            f"decoder layers, and the last one is never tapped by default; lower "
            "target.num_tapped or list target.tapped_layers explicitly"
        )
    if cfg.num_tapped == 1:
        return [(first + last) // 2]
    step = (last - first) / (cfg.num_tapped - 1)
    return [int(round(first + j * step)) for j in range(cfg.num_tapped)]


def check_attn_implementation(cfg: TargetConfig, config: PretrainedConfig) -> None:
    """Refuse, from the target's config alone, an attention backend transformers would refuse
    as the weights load (a typo, a name it lacks, flash_attention_2 without its package): that
    came after --out was made, without naming the key (flash_attention_2's as a bug). The
    model is built on the meta device (no memory, ~0.1 s at 8B), where transformers runs the
    same check; any other failure there is left to the load."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(
                config,
                attn_implementation=cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
            )
    except (ValueError, ImportError) as err:
        if cfg.attn_implementation not in str(err) and "attention" not in str(err).lower():
            return  # not the backend's refusal: the load will say what it is
        raise ValueError(
            f"target.attn_implementation={cfg.attn_implementation!r} cannot run "
            f"{cfg.model}: {err} Pass one it supports, e.g. --set "
            "target.attn_implementation=sdpa (the default) or eager"
        ) from None
    except Exception:  # noqa: BLE001 (a model that cannot be built on meta: the load decides)
        return


def load_target(
    cfg: TargetConfig, device: torch.device, devices: list[str] | None = None
) -> torch.nn.Module:
    """The causal LM in eval mode on `device`, or spread over `devices` when cfg.device_map."""
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    # process-wide, and only the target runs in a generate or extract process; the CUDA flag
    # alone (set_float32_matmul_precision would also change oneDNN's CPU matmuls), and only
    # where the keys and provenance record it (runs_tf32)
    torch.backends.cuda.matmul.allow_tf32 = runs_tf32(cfg.dtype, cfg.matmul_precision)
    kwargs: dict[str, Any] = dict(
        revision=cfg.revision,
        dtype=dtype,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if cfg.device_map and devices and devices[0] != "cpu":
        if not has_accelerate:
            raise ValueError(
                "target.device_map=true needs the `accelerate` package; install it "
                "(pip install accelerate) or run one copy per GPU with target.device_map=false"
            )
        # leave room on each GPU for activations and the LM-head chunk
        ids = [int(d.split(":")[1]) for d in devices]
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {i: int(torch.cuda.mem_get_info(i)[0] * 0.85) for i in ids}
    elif has_accelerate:
        kwargs["device_map"] = {"": device}  # load straight onto the device
    model = AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
    if "device_map" not in kwargs:
        model = model.to(device)
    return model.eval()


def save_target_head(
    model: torch.nn.Module, path: Path, before_commit: Callable[[], None] | None = None
) -> None:
    """Write embed_tokens / final norm / lm_head (bf16) for stage 2: to a temporary file,
    flushed, then renamed to `path`. `before_commit` runs just before the rename and raises to
    call it off: the temporary file is then removed and nothing is committed."""
    base = model.get_decoder()
    tensors = {
        "embed_tokens.weight": model.get_input_embeddings().weight,
        "norm.weight": base.norm.weight,
        "lm_head.weight": model.get_output_embeddings().weight,
    }
    # clone: tied embeddings share storage, which safetensors refuses to save twice
    tensors = {k: v.detach().to("cpu", torch.bfloat16).clone() for k, v in tensors.items()}
    eps = getattr(text_config(model.config), "rms_norm_eps", None)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"rms_norm_eps": str(eps)})
        # on disk before the rename, as a shard is: after a power cut an empty head file would
        # pass for a written one (a resume writes it only when it is missing)
        fsync_path(tmp)
        if before_commit is not None:
            before_commit()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


@dataclass
class BatchOutput:
    """Per valid token of a batch, rows in row-major order of the (right-padded) batch."""

    hidden_NKD: torch.Tensor  # bf16, or uint8 fp8 bits / nvfp4 rows
    hidden_scale_NK: torch.Tensor | None  # float32, only with fp8 or nvfp4 hidden states
    argmax_N: torch.Tensor  # int32
    topk_ids_Nk: torch.Tensor  # int32
    topk_logits_Nk: torch.Tensor  # float32
    lse_N: torch.Tensor  # float32
    logits_NV: torch.Tensor | None  # bf16, only when full logits are stored


class TappedTarget:
    """Runs the base model with hooks on the tapped decoder layers, then the head in chunks."""

    def __init__(
        self,
        model: torch.nn.Module,
        tapped_layers: list[int],
        topk: int,
        head_chunk: int,
        full_logits: bool,
        hidden_dtype: str,
        compile_head: bool | None = None,
    ) -> None:
        self.model = model
        self.base = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.tapped = tapped_layers
        self.topk = topk
        self.head_chunk = head_chunk
        self.full_logits = full_logits
        self.hidden_dtype = hidden_dtype
        self.device = self.base.get_input_embeddings().weight.device
        # unset: compiled on a GPU (measured faster, same bits but the log-sum-exp's rounding),
        # eager on the CPU (inductor's C++ builds cost more than short CPU runs gain)
        self.compile_head = self.device.type == "cuda" if compile_head is None else compile_head
        # device-to-host copies of the outputs overlap the next batch on this stream (fill_shard)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._valid_idx: torch.Tensor | None = None
        self._hidden_NKD: torch.Tensor | None = None
        self._scale_NK: torch.Tensor | None = None

    def _hook(self, k: int) -> Callable[[torch.nn.Module, Any, Any], None]:
        def keep(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            hidden_BTD = output[0] if isinstance(output, tuple) else output
            idx = self._valid_idx.to(hidden_BTD.device, non_blocking=True)
            # only the valid rows, as stored: never hold a full layer in its compute dtype
            # longer than this hook runs. Quantized here, on the layer's device, from the
            # layer's own dtype: the device-to-host copy moves the stored bytes only
            valid_ND = hidden_BTD.flatten(0, 1).index_select(0, idx)
            stored_NW, scale_N = encode_hidden(valid_ND, self.hidden_dtype, self.compile_head)
            self._hidden_NKD[:, k] = stored_NW.to(self.device)
            if scale_N is not None:
                self._scale_NK[:, k] = scale_N.to(self.device)

        return keep

    def _tap_module(self, layer_id: int) -> torch.nn.Module:
        """The module whose output is layer `layer_id` = transformers' hidden_states[id + 1].

        For the last layer that is the output of the final norm (transformers replaces the last
        entry of hidden_states by the normed one), as transformers-based drafting reads it;
        vLLM and SGLang do not (common.target_config.last_layer_tapped_note).
        """
        if layer_id < len(self.base.layers) - 1:
            return self.base.layers[layer_id]
        final_norm = getattr(self.base, "norm", None)
        if final_norm is None:
            raise ValueError(
                f"tapped layer {layer_id} is the last layer, whose hidden state is taken after "
                "the final norm, but this model has no `norm` module; tap layers below it"
            )
        return final_norm

    @torch.inference_mode()
    def forward(self, input_ids_BT: torch.Tensor, lengths_B: list[int]) -> BatchOutput:
        """Run right-padded rows (each row one document from position 0) and return the stored
        quantities for their valid tokens."""
        B, T = input_ids_BT.shape
        mask_BT = torch.arange(T)[None, :] < torch.tensor(lengths_B)[:, None]
        valid_idx = mask_BT.flatten().nonzero().squeeze(1)
        num_valid, D = len(valid_idx), self.base.config.hidden_size
        pin = self.device.type == "cuda"
        self._valid_idx = (valid_idx.pin_memory() if pin else valid_idx).to(
            self.device, non_blocking=True
        )
        K, scaled = len(self.tapped), HIDDEN_DTYPES[self.hidden_dtype][1]
        width = hidden_row_width(self.hidden_dtype, D)
        stored = torch.uint8 if scaled else torch.bfloat16
        self._hidden_NKD = torch.empty(num_valid, K, width, dtype=stored, device=self.device)
        if scaled:
            self._scale_NK = torch.empty(num_valid, K, dtype=torch.float32, device=self.device)
        # hooks live only during our forward, so the model stays usable as a plain LM
        hooks = [
            self._tap_module(layer_id).register_forward_hook(self._hook(k))
            for k, layer_id in enumerate(self.tapped)
        ]
        try:
            # No attention mask: rows are right-padded and attention is causal, so a valid
            # token only ever sees earlier valid tokens of its own row. Without a padding
            # mask SDPA takes its fused causal kernel instead of the slower masked path.
            # from page-locked memory the copy is asynchronous; from pageable memory CUDA
            # first waits for the stream, so the host could never run ahead of the GPU (and
            # the GPU would idle while the host prepares the next shard)
            ids_BT = input_ids_BT.pin_memory() if pin else input_ids_BT
            out = self.base(input_ids=ids_BT.to(self.device, non_blocking=True), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        # last_hidden_state is after the final norm: exactly what the LM head consumes
        final_ND = out.last_hidden_state.flatten(0, 1).index_select(
            0, self._valid_idx.to(out.last_hidden_state.device)
        )
        result = self._head(final_ND, self._hidden_NKD, self._scale_NK)
        self._valid_idx = self._hidden_NKD = self._scale_NK = None
        return result

    def _head(
        self, final_ND: torch.Tensor, hidden_NKD: torch.Tensor, scale_NK: torch.Tensor | None
    ) -> BatchOutput:
        N, k, dev = final_ND.shape[0], self.topk, self.device
        argmax_N = torch.empty(N, dtype=torch.int32, device=dev)
        ids_Nk = torch.empty(N, k, dtype=torch.int32, device=dev)
        vals_Nk = torch.empty(N, k, dtype=torch.float32, device=dev)
        lse_N = torch.empty(N, dtype=torch.float32, device=dev)
        logits_NV = None
        if self.full_logits:
            logits_NV = torch.empty(N, self.head.out_features, dtype=torch.bfloat16, device=dev)
        for lo in range(0, N, self.head_chunk):
            hi = min(lo + self.head_chunk, N)
            raw_CV = self.head(final_ND[lo:hi])
            # top-k and argmax on the head's own dtype: the same values and ids as on an fp32
            # copy (the cast is exact and monotonic) at a fraction of the memory traffic; only
            # the log-sum-exp accumulates in fp32
            argmax_C, ids_Ck, vals_Ck, lse_C = head_chunk_stats(
                raw_CV, k, self.head_chunk, self.compile_head
            )
            argmax_N[lo:hi], lse_N[lo:hi] = argmax_C.to(dev), lse_C.to(dev)
            vals_Nk[lo:hi], ids_Nk[lo:hi] = vals_Ck.to(dev), ids_Ck.to(dev, torch.int32)
            if logits_NV is not None:
                logits_NV[lo:hi] = raw_CV.to(dev, torch.bfloat16)
        return BatchOutput(hidden_NKD, scale_NK, argmax_N, ids_Nk, vals_Nk, lse_N, logits_NV)
