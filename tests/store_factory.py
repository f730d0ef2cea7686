"""Build small dflash stores (FORMAT.md, version 1) directly, without a target model.

Used by the stage-2 tests before (and besides) `dflash extract`: writing the layout from the
contract text alone checks the contract independently of the writer. The data are learnable on
purpose: every document walks a fixed random cycle of the vocabulary (`next = perm[token]`), the
stored target argmax is that next token, and the tapped hidden states carry an embedding of the
current token, so a drafter can learn to predict whole blocks and its accuracy rises.

Legend: N sequences of a shard, S tokens per sequence, K tapped layers, D hidden size,
k top-k, V vocabulary.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from safetensors.torch import save_file
from zarr.codecs import ZstdCodec

from common.store import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEAD_FILE,
    bf16_to_bits,
    encode_hidden,
    shard_name,
)
from common.store_files import record_shard_files


@dataclass
class FactorySpec:
    """What the synthetic store looks like; defaults give a tiny learnable store."""

    num_sequences: int = 12
    seq_len: int = 64
    sequences_per_shard: int = 5
    hidden_size: int = 64
    tapped_layers: list[int] = field(default_factory=lambda: [0, 2])
    vocab_size: int = 48
    topk: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    min_doc_len: int = 12
    max_doc_len: int = 40
    prompt_len: int = 3  # first tokens of each document carry no loss (a "prompt")
    chunk_tokens: int = 32
    mask_token_id: int | None = 3
    pad_token_id: int = 0
    hidden_dtype: str = "bfloat16"  # or "float8_e4m3fn" / "nvfp4": uint8 bytes + hidden_scale
    format_version: int = FORMAT_VERSION
    complete: bool = True
    seed: int = 0


def target_config(spec: FactorySpec) -> dict[str, Any]:
    """A Qwen3-style target config dict of the sizes in `spec` (what extract records)."""
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size,
        "num_hidden_layers": 4,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _pack_sequence(
    rng: np.random.Generator, spec: FactorySpec, successor: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """One packed sequence: tokens, loss mask, positions and (start, length) of its documents."""
    S = spec.seq_len
    tokens = np.full(S, spec.pad_token_id, np.int32)
    loss = np.zeros(S, np.uint8)
    pos = np.zeros(S, np.int32)
    docs: list[tuple[int, int]] = []
    start = 0
    while S - start >= spec.min_doc_len:
        length = int(rng.integers(spec.min_doc_len, spec.max_doc_len + 1))
        length = min(length, S - start)
        # leave padding at the end of some sequences, as real packing does
        if start > 0 and rng.random() < 0.15:
            break
        tok = int(rng.integers(4, spec.vocab_size))  # ids 0..3 stay "special"
        for t in range(length):
            tokens[start + t] = tok
            tok = int(successor[tok])
        loss[start + spec.prompt_len : start + length] = 1
        pos[start : start + length] = np.arange(length)
        docs.append((start, length))
        start += length
    return tokens, loss, pos, docs


def _array(group: zarr.Group, name: str, data: np.ndarray, chunk_tokens: int) -> None:
    chunks = (
        (1, min(chunk_tokens, data.shape[1]), *data.shape[2:]) if data.ndim >= 2 else data.shape
    )
    group.create_array(
        name,
        shape=data.shape,
        dtype=data.dtype,
        chunks=chunks,
        shards=data.shape if data.ndim >= 2 else None,
        compressors=ZstdCodec(level=1),
        fill_value=0,
    )[...] = data


_built: dict[str, Path] = {}  # a spec's store, as written once: copied from, never changed


def build_store(path: str | Path, spec: FactorySpec | None = None) -> Path:
    """Write a complete (or, with spec.complete=False, unfinished) store at `path`.

    The store is a function of `spec` alone (seeded, no path in it): the first build of a spec
    in this process is kept aside and later builds of it into a new folder copy its files
    (the same bytes: ~20 ms where writing them takes 0.1-0.7 s, and most of the suite's builds
    repeat a spec). A folder that already holds files is written as before."""
    spec = spec or FactorySpec()
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        return _write_store(path, spec)
    key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if key not in _built:
        _built[key] = _write_store(Path(_cache_root()) / str(len(_built)), spec)
    # plain copies: contents and modes, new times, as the files written afresh had
    shutil.copytree(_built[key], path, copy_function=shutil.copy, dirs_exist_ok=True)
    return path


@functools.cache
def _cache_root() -> str:
    root, owner = tempfile.mkdtemp(prefix="dflash-store-factory-"), os.getpid()

    def remove() -> None:  # by the process that made it (not a forked child that exits)
        if os.getpid() == owner:
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove)
    return root


def _write_store(path: Path, spec: FactorySpec) -> Path:
    rng = np.random.default_rng(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    V, D, K, S, k = (
        spec.vocab_size,
        spec.hidden_size,
        len(spec.tapped_layers),
        spec.seq_len,
        spec.topk,
    )
    successor = np.arange(V)
    order = 4 + rng.permutation(V - 4)
    successor[order] = np.roll(order, -1)  # one cycle through every non-special id
    feature_table_VKD = torch.randn(V, K, D, generator=gen)

    # Head rows of norm ~4: logits of a unit-RMS hidden state are O(4) whatever D, so CE
    # starts near log(V) as with a real LM head (not at tens of nats).
    scale = 4.0 / D**0.5
    embed_VD = (torch.randn(V, D, generator=gen) * scale).to(torch.bfloat16)
    head = {
        "embed_tokens.weight": embed_VD,
        "norm.weight": torch.ones(D, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(V, D, generator=gen) * scale).to(torch.bfloat16),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(head, str(path / HEAD_FILE), metadata={"rms_norm_eps": "1e-06"})

    num_shards = -(-spec.num_sequences // spec.sequences_per_shard)
    totals = dict.fromkeys(["documents", "tokens", "loss_tokens", "padding_tokens"], 0)
    written = num_shards if spec.complete else max(num_shards - 1, 0)
    for index in range(written):
        n = min(spec.sequences_per_shard, spec.num_sequences - index * spec.sequences_per_shard)
        tokens_NS = np.zeros((n, S), np.int32)
        loss_NS = np.zeros((n, S), np.uint8)
        pos_NS = np.zeros((n, S), np.int32)
        doc_NS = np.full((n, S), -1, np.int32)
        doc_rows: list[tuple[int, int, int]] = []  # (sequence, start, length)
        for i in range(n):
            tokens_NS[i], loss_NS[i], pos_NS[i], docs = _pack_sequence(rng, spec, successor)
            for start, length in docs:
                doc_NS[i, start : start + length] = len(doc_rows)
                doc_rows.append((i, start, length))
        real_NS = doc_NS >= 0
        argmax_NS = np.where(real_NS, successor[tokens_NS], 0).astype(np.int32)
        hidden = feature_table_VKD[torch.from_numpy(tokens_NS).long()]
        hidden = hidden + 0.05 * torch.randn(hidden.shape, generator=gen)
        # where, not a product: padding must be +0 bits (a product leaves -0.0 on negatives)
        hidden = torch.where(torch.from_numpy(real_NS)[..., None, None], hidden, 0.0)
        topk_ids = rng.integers(0, V, (n, S, k)).astype(np.int32)
        topk_ids[..., 0] = argmax_NS
        topk_logits = np.sort(rng.normal(size=(n, S, k)), axis=-1)[..., ::-1].astype(np.float32)
        topk_logits[..., 0] += 3.0
        lse = (np.log(np.exp(topk_logits).sum(-1)) + 0.5).astype(np.float32)

        group = zarr.open_group(path / "shards" / shard_name(index), mode="w", zarr_format=3)
        _array(group, "tokens", tokens_NS, spec.chunk_tokens)
        _array(group, "loss_mask", loss_NS, spec.chunk_tokens)
        _array(group, "position_ids", pos_NS, spec.chunk_tokens)
        _array(group, "document_ids", doc_NS, spec.chunk_tokens)
        stored, scale = encode_hidden(hidden, spec.hidden_dtype)
        if scale is not None:
            _array(group, "hidden", stored.numpy(), spec.chunk_tokens)
            _array(group, "hidden_scale", scale.numpy(), spec.chunk_tokens)
        else:
            _array(group, "hidden", bf16_to_bits(stored), spec.chunk_tokens)
        _array(group, "target_argmax", argmax_NS, spec.chunk_tokens)
        _array(group, "topk_ids", topk_ids, spec.chunk_tokens)
        _array(group, "topk_logits", np.ascontiguousarray(topk_logits), spec.chunk_tokens)
        _array(group, "logsumexp", lse, spec.chunk_tokens)
        rows = np.array(doc_rows, np.int32).reshape(-1, 3)
        _array(group, "doc_source_index", np.arange(len(rows), dtype=np.int64), 0)
        _array(group, "doc_piece", np.zeros(len(rows), np.int32), 0)
        _array(group, "doc_sequence", rows[:, 0].copy(), 0)
        _array(group, "doc_start", rows[:, 1].copy(), 0)
        _array(group, "doc_length", rows[:, 2].copy(), 0)
        num_tokens = int(real_NS.sum())
        group.attrs["dflash_shard"] = {
            "index": index,
            "num_sequences": n,
            "num_documents": len(rows),
            "num_tokens": num_tokens,
            "num_loss_tokens": int(loss_NS.sum()),
            "split_documents": 0,
            "truncated_documents": 0,
            "dropped_tokens": 0,
        }
        record_shard_files(path / "shards" / shard_name(index))  # FORMAT.md v2, as extract does
        totals["documents"] += len(rows)
        totals["tokens"] += num_tokens
        totals["loss_tokens"] += int(loss_NS.sum())
        totals["padding_tokens"] += n * S - num_tokens

    attrs: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": spec.format_version,
        "complete": spec.complete,
        "created_by": {
            "dflash_offline": "test-factory",
            "torch": torch.__version__,
            "zarr": zarr.__version__,
        },
        "target": {
            "name_or_path": "factory",
            "revision": None,
            "model_type": "qwen3",
            "num_hidden_layers": 4,
            "config": target_config(spec),
        },
        "tokenizer": {
            "name_or_path": "factory",
            "vocab_size": V,
            "chat_template": None,
            "eos_token_id": 2,
            "pad_token_id": spec.pad_token_id,
            "mask_token_id": spec.mask_token_id,
        },
        "tapped_layers": list(spec.tapped_layers),
        "hidden_size": D,
        "vocab_size": V,
        "seq_len": S,
        "topk": k,
        "full_logits": False,
        "hidden_dtype": spec.hidden_dtype,
        "sequences_per_shard": spec.sequences_per_shard,
        "num_shards": num_shards,
        "dataset": {
            "path": "synthetic",
            "split": "train",
            "name": None,
            "format": "text",
            "num_rows": totals["documents"],
        },
        "extract_config": {},
        "content_key": f"factory-{spec.seed}",
    }
    if spec.complete:
        attrs["counts"] = {
            "sequences": spec.num_sequences,
            "source_documents": totals["documents"],
            "split_documents": 0,
            "truncated_documents": 0,
            "dropped_tokens": 0,
            **totals,
        }
    root = {"zarr_format": 3, "node_type": "group", "attributes": {"dflash": attrs}}
    (path / "zarr.json").write_text(json.dumps(root, indent=2))
    return path
