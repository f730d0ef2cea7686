"""What one extraction computes: the job every process derives identically from the config
(target checks, tokenized documents, packing plan, root attributes with the content key), and
the filling of one shard's host buffers from target forwards.

Legend: B batch rows, T padded length, M = n * S token slots of a shard, P pieces (stored
documents) of a shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import transformers
import zarr
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from common.config import to_dict
from common.generated import PROMPT_SUFFIX_LEFT_OUT, provenance, read_manifest
from common.logging import get_logger
from common.store import (
    FORMAT_NAME,
    FORMAT_VERSION,
    hidden_bytes_per_token,
    hidden_dtype_problem,
)
from common.target_config import last_layer_tapped_note
from stage1_extract.config import ExtractConfig
from stage1_extract.data import PreparedData, prepare_documents, special_affixes
from stage1_extract.fingerprints import documents_sha256, weights_fingerprint
from stage1_extract.host_buffers import ShardBuffers
from stage1_extract.packing import PackingPlan, num_shards, plan_packing, shard_pieces
from stage1_extract.shard_writer import ShardJob
from stage1_extract.store_root import content_key, key_parts
from stage1_extract.target import (
    TappedTarget,
    check_attn_implementation,
    config_dict,
    load_target_config,
    max_positions,
    resolve_tapped_layers,
    target_revision,
    text_config,
)
from stage1_extract.writer import ShardTask


@dataclass
class ExtractJob:
    cfg: ExtractConfig
    store: Path
    tapped: list[int]
    hidden_size: int
    vocab_size: int  # rows of the LM head
    pad_id: int
    prepared: PreparedData
    lengths: np.ndarray  # int64 tokens of each prepared document
    plan: PackingPlan
    num_shards: int
    attrs: dict[str, Any]  # root attributes (complete: false)
    key_parts: dict[str, Any]  # what attrs["content_key"] hashes (store_root.key_parts)

    @property
    def source_documents(self) -> int:
        return len(np.unique(self.plan.doc_row))

    @property
    def shard_bytes(self) -> int:
        """Uncompressed bytes of a full shard (an upper bound for the disk)."""
        hidden = hidden_bytes_per_token(
            self.cfg.store.hidden_dtype, len(self.tapped), self.hidden_size
        )
        per_token = hidden + self.cfg.verifier.topk * 8 + 21
        if self.cfg.verifier.store_full_logits:
            per_token += self.vocab_size * 2
        return self.cfg.store.sequences_per_shard * self.cfg.packing.seq_len * per_token

    def shard_tokens(self, index: int) -> int:
        pieces = shard_pieces(self.plan, index, self.cfg.store.sequences_per_shard)
        return int(self.plan.length[pieces].sum())


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def load_tokenizer(cfg: ExtractConfig, model_name: str = "target.model") -> PreTrainedTokenizerBase:
    """The target's tokenizer (target.tokenizer, else the model's); `model_name` is how the user
    gave the model (--model or target.model), for `load_target_config`'s error."""
    name = cfg.target.tokenizer or cfg.target.model
    revision = None if cfg.target.tokenizer else cfg.target.revision
    try:
        return AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=cfg.target.trust_remote_code
        )
    except (OSError, ValueError) as err:
        if not cfg.target.tokenizer:
            # the model's own tokenizer: a missing folder, a folder of something else or an
            # unreachable hub id is a wrong --model (named so), not a tokenizer to add
            # (generate loads the tokenizer before the target's config)
            load_target_config(cfg.target, model_name)
        raise ValueError(
            f"cannot load the tokenizer from {name} ({err}); pass a folder or hub id holding "
            "one with --set target.tokenizer=..."
        ) from err


def reserved_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The first added token named like a mask (<|mask|>, [MASK]; the tokenizer's declared
    mask token among them, so this can equal its mask_token_id), else the first reserved
    special token (Llama-3's <|reserved_special_token_0|>): a real embedding row that no text
    produces, a safe id for the drafter's mask slots."""
    added = sorted(tokenizer.get_added_vocab().items(), key=lambda item: item[1])
    for marker in ("mask", "reserved"):
        found = next((index for token, index in added if marker in token.lower()), None)
        if found is not None:
            return found
    return None


def document_lengths(table: pa.Table) -> np.ndarray:
    """Token count of every document of the tokenized table (input_ids column)."""
    return pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)


def check_seq_len(cfg: ExtractConfig, config: PretrainedConfig) -> None:
    """Refuse a packed sequence longer than the target's positions (documents run from
    position 0, so a piece of up to seq_len tokens reaches position seq_len - 1): past them its
    hidden states and logits are out of distribution, without any error."""
    found = max_positions(config)
    if found is None or cfg.packing.seq_len <= found.limit:
        return
    raise ValueError(
        f"packing.seq_len={cfg.packing.seq_len} is more than {cfg.target.model}'s "
        f"{found.source} ({found.limit}): its hidden states and logits past that many "
        "positions are out of what it was trained on (RoPE extrapolation), and the drafter "
        f"would learn from them; --set packing.seq_len={found.limit} or lower (longer "
        "documents are split, packing.overlong)"
    )


def check_prompt_suffix(manifest: dict[str, Any], suffix: list[int], path: str) -> None:
    """Refuse completion rows that an older `dflash generate` wrote after the prompt and the
    tokenizer's `suffix` (an EOS, `special_affixes`): extract now leaves the suffix out, so the
    stored context would not be the one the target wrote them in. Checked before the rows are
    tokenized (minutes on a large folder)."""
    content = manifest.get("content", {})
    if suffix and content.get("format") == "completion" and PROMPT_SUFFIX_LEFT_OUT not in content:
        raise ValueError(
            f"data {path} holds completion rows written by an older `dflash generate`, which "
            f"fed the target each prompt followed by the ids {suffix} the "
            "tokenizer appends (an end of sequence); extract now leaves them out of the prompt, "
            "so these completions no longer follow their context: rerun that `dflash generate` "
            "with --overwrite (or into a new --out), then extract"
        )


def plan_job(cfg: ExtractConfig, model_name: str = "target.model") -> ExtractJob:
    """Check the target, tokenize, plan the packing and build the root attributes; the same
    result in every process (raises ValueError on bad input before anything is written).
    `model_name`: how the user gave the target (--model or target.model), for its errors."""
    out = Path(cfg.store.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for the store (new or existing)")
    manifest = read_manifest(cfg.data.path)
    if manifest is not None and not manifest.get("complete"):
        # a killed or running `dflash generate` left only some chunks: a store of them would
        # silently miss the rest, and a rerun of generate would not change the store
        raise ValueError(
            f"data {cfg.data.path} is an unfinished `dflash generate` folder (its manifest "
            "says complete: false); rerun the same `dflash generate` to finish it, then extract"
        )
    config = load_target_config(cfg.target, model_name)
    if cfg.target.attn_implementation == "sdpa_gqa_decode":
        # generate's decode-step backend, registered with transformers when generate imports
        # it: by name, so that the refusal does not hang on whether this process imported it
        raise ValueError(
            "target.attn_implementation='sdpa_gqa_decode' cannot run in extract: it is dflash "
            "generate's decoding backend, and extract runs whole sequences; pass --set "
            "target.attn_implementation=sdpa (the default) or eager"
        )
    check_attn_implementation(cfg.target, config)
    text = text_config(config)
    tapped = resolve_tapped_layers(cfg.target, text.num_hidden_layers)
    if note := last_layer_tapped_note(tapped, text.num_hidden_layers):
        # said before hours of extraction, not only when the drafter is exported
        get_logger().warning("target.tapped_layers: %s", note)
    if cfg.verifier.topk > text.vocab_size:
        raise ValueError(
            f"verifier.topk={cfg.verifier.topk} is more than {cfg.target.model}'s vocabulary "
            f"of {text.vocab_size}; lower verifier.topk (32 is the default)"
        )
    if problem := hidden_dtype_problem(cfg.store.hidden_dtype, text.hidden_size):
        raise ValueError(f"{cfg.target.model}: {problem}")
    check_seq_len(cfg, config)
    tokenizer = load_tokenizer(cfg, model_name)
    if manifest is not None:  # the data were written by `dflash generate`
        check_prompt_suffix(manifest, special_affixes(tokenizer)[1], cfg.data.path)
    truncate_to = cfg.packing.seq_len if cfg.packing.overlong == "truncate" else None
    prepared = prepare_documents(cfg.data, tokenizer, truncate_to)
    # one read of the tokenized documents (a copy when rows were filtered) for the lengths
    # and the fingerprint
    documents = prepared.dataset.with_format("arrow")[:]
    lengths = document_lengths(documents)
    if len(lengths) == 0:
        raise ValueError(
            f"data {cfg.data.path}: no documents to extract ({prepared.num_rows} rows read, "
            f"skipped: {prepared.skipped}); check the data and data.on_invalid"
        )
    plan = plan_packing(lengths, cfg.packing.seq_len, cfg.packing.overlong, cfg.packing.strategy)
    shards = num_shards(plan, cfg.store.sequences_per_shard)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # many causal LMs ship without a pad token: pad with EOS
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    chat_template = tokenizer.chat_template
    attrs: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "created_by": {
            "dflash_offline": _version("dflash-offline"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "zarr": zarr.__version__,
        },
        "target": {
            "name_or_path": cfg.target.model,
            "revision": target_revision(config, cfg.target),
            "model_type": config.model_type,
            "num_hidden_layers": text.num_hidden_layers,
            "config": config_dict(config),
        },
        "tokenizer": {
            "name_or_path": cfg.target.tokenizer or cfg.target.model,
            "vocab_size": len(tokenizer),
            "chat_template": chat_template if isinstance(chat_template, str) else None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": pad_id,
            "mask_token_id": tokenizer.mask_token_id,
            "reserved_token_id": reserved_token_id(tokenizer),
        },
        "tapped_layers": tapped,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "seq_len": cfg.packing.seq_len,
        "topk": cfg.verifier.topk,
        "full_logits": cfg.verifier.store_full_logits,
        "hidden_dtype": cfg.store.hidden_dtype,
        "sequences_per_shard": cfg.store.sequences_per_shard,
        "num_shards": shards,
        "dataset": {
            "path": cfg.data.path,
            "split": cfg.data.split,
            "name": cfg.data.name,
            "format": prepared.format,
            "num_rows": prepared.num_rows,
        },
        "extract_config": to_dict(cfg),
    }
    if prepared.suffix_left_out:
        # named only here: other stores keep their content key, and a store begun with that
        # suffix in its documents (before it was left out) is not resumed with new shards
        attrs["tokenizer"]["suffix_left_out"] = prepared.suffix_left_out
    if manifest is not None:  # the data were written by `dflash generate`: keep where from
        attrs["generation"] = provenance(manifest)
    digest = hashlib.sha256(lengths.tobytes()).hexdigest()
    parts = key_parts(attrs, digest, prepared.skipped)
    attrs["content_key"] = content_key(parts)
    attrs["fingerprints"] = {
        "documents_sha256": documents_sha256(documents),
        "target_weights_sha256": weights_fingerprint(cfg.target.model),
    }
    return ExtractJob(
        cfg,
        out,
        tapped,
        text.hidden_size,
        text.vocab_size,
        pad_id,
        prepared,
        lengths,
        plan,
        shards,
        attrs,
        parts,
    )


def _batches(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Pieces longest first, grouped while rows * longest <= budget (at least one per batch)."""
    order = np.argsort(-lengths, kind="stable")
    batches: list[list[int]] = []
    for j in order.tolist():
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= budget:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def tapped_target(job: ExtractJob, model: torch.nn.Module) -> TappedTarget:
    """The target wrapped as this job extracts it (tapped layers, top-k, head chunks, dtype)."""
    cfg = job.cfg
    return TappedTarget(
        model,
        job.tapped,
        cfg.verifier.topk,
        cfg.verifier.head_chunk_tokens,
        cfg.verifier.store_full_logits,
        cfg.store.hidden_dtype,
        cfg.verifier.compile_head,
    )


@contextmanager
def _on_stream(
    stream: torch.cuda.Stream | None, after: torch.cuda.Stream | None, sources: list[torch.Tensor]
) -> Iterator[None]:
    """Run the enclosed copies on `stream` once `after` has produced `sources` (no-op without a
    stream); the sources' memory is not reused before the copies are done."""
    if stream is None or after is None:
        yield
        return
    stream.wait_stream(after)
    with torch.cuda.stream(stream):
        yield
    for source in sources:
        source.record_stream(stream)


def fill_shard(
    job: ExtractJob,
    target: TappedTarget,
    index: int,
    buffers: ShardBuffers,
    progress: Callable[[int], Any],
) -> ShardJob:
    """Run shard `index`'s documents through the target and lay them out in `buffers`."""
    cfg, plan, S = job.cfg, job.plan, job.cfg.packing.seq_len
    per_shard = cfg.store.sequences_per_shard
    pieces = shard_pieces(plan, index, per_shard)
    n = min(per_shard, plan.num_sequences - index * per_shard)
    rows, offsets, lengths = plan.doc_row[pieces], plan.src_offset[pieces], plan.length[pieces]
    sequences = plan.sequence[pieces] - index * per_shard
    first_slot = sequences * S + plan.start[pieces]
    unique_rows, which = np.unique(rows, return_inverse=True)
    data = job.prepared.dataset[unique_rows.tolist()]

    m, host = n * S, buffers.tensors
    tokens_M, loss_mask_M = host["tokens"][:m].numpy(), host["loss_mask"][:m].numpy()
    position_ids_M, document_ids_M = (
        host["position_ids"][:m].numpy(),
        host["document_ids"][:m].numpy(),
    )
    tokens_M[:], loss_mask_M[:], position_ids_M[:], document_ids_M[:] = job.pad_id, 0, 0, -1
    piece_ids = []
    for j in range(len(pieces)):
        lo, L, slot = int(offsets[j]), int(lengths[j]), int(first_slot[j])
        ids = np.asarray(data["input_ids"][which[j]][lo : lo + L], np.int32)
        piece_ids.append(torch.from_numpy(ids).long())
        tokens_M[slot : slot + L] = ids
        loss_mask_M[slot : slot + L] = data["loss_mask"][which[j]][lo : lo + L]
        position_ids_M[slot : slot + L] = np.arange(L)
        document_ids_M[slot : slot + L] = j
    # buffers are reused shard after shard: padding slots must read as zeros
    padding = torch.from_numpy(np.flatnonzero(document_ids_M < 0))
    device_arrays = buffers.device_arrays()
    for array in device_arrays:
        array[padding] = 0
    if "hidden_scale" in host:  # padding is a zero row: scale 1, as quantize_fp8
        host["hidden_scale"][padding] = 1.0

    # Copies to the host run on their own stream, so the copy engine moves one batch's outputs
    # while the GPU computes the next batch (on the compute stream they would run in between).
    compute = torch.cuda.current_stream(target.device) if target.copy_stream else None
    finite_ok = torch.ones((), dtype=torch.bool, device=target.device)
    for batch in _batches(lengths, job.cfg.run.batch_tokens):
        T = int(lengths[batch[0]])
        ids_BT = torch.full((len(batch), T), job.pad_id, dtype=torch.long)
        for r, j in enumerate(batch):
            ids_BT[r, : lengths[j]] = piece_ids[j]
        out = target.forward(ids_BT, [int(lengths[j]) for j in batch])
        # checked on the device: a host scan of every shard's bytes would compete with the
        # writers for CPU time
        # fp8: the bits have no Inf, and a NaN/Inf row has a NaN/Inf scale (amax / 448)
        hidden = out.hidden_NKD if out.hidden_scale_NK is None else out.hidden_scale_NK
        finite_ok &= torch.isfinite(hidden).all() & torch.isfinite(out.lse_N).all()
        outputs = [out.hidden_NKD]
        outputs += [out.hidden_scale_NK] if out.hidden_scale_NK is not None else []
        outputs += [out.argmax_N, out.topk_ids_Nk, out.topk_logits_Nk, out.lse_N]
        outputs += [out.logits_NV] if out.logits_NV is not None else []
        with _on_stream(target.copy_stream, compute, outputs):
            row = 0
            for j in batch:
                L, slot = int(lengths[j]), int(first_slot[j])
                for dst, src in zip(device_arrays, outputs, strict=True):
                    dst[slot : slot + L].copy_(src[row : row + L], non_blocking=True)
                row += L
        progress(row)

    finite = torch.empty((), dtype=torch.bool, pin_memory=target.device.type == "cuda")
    ready = None
    with _on_stream(target.copy_stream, compute, [finite_ok]):
        finite.copy_(finite_ok, non_blocking=True)
        if target.copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record(target.copy_stream)
    doc_length = job.lengths[rows]
    over = doc_length > S
    overlong = cfg.packing.overlong
    attrs = {
        "index": index,
        "num_sequences": n,
        "num_documents": len(pieces),
        "num_tokens": int(lengths.sum()),
        "num_loss_tokens": int(loss_mask_M.sum()),
        "split_documents": int((over & (plan.piece[pieces] == 0)).sum())
        if overlong == "split"
        else 0,
        "truncated_documents": int(over.sum()) if overlong == "truncate" else 0,
        "dropped_tokens": int((doc_length - lengths)[over].sum()) if overlong == "truncate" else 0,
    }
    documents = {
        "doc_source_index": np.asarray(data["source_index"], np.int64)[which],
        "doc_piece": plan.piece[pieces].astype(np.int32),
        "doc_sequence": sequences.astype(np.int32),
        "doc_start": plan.start[pieces].astype(np.int32),
        "doc_length": lengths.astype(np.int32),
    }
    return ShardJob(ShardTask(index, n, documents, attrs), buffers, ready, finite)
