"""Small FORMAT.md stores built by hand for the `dflash inspect` tests.

A store is described by its packed sequences: each sequence is a list of documents, each
document a list of (token ids, is-loss) segments. `build_store` writes the root group, the
target head, one Zarr v3 group per shard (sharding codec, zstd) with arrays of the dtypes and
shapes of FORMAT.md, and a `.tmp-shard-...` folder that readers must ignore. Verifier arrays
come from random float32 logits, so top-k, argmax and log-sum-exp are mutually consistent.
The numbers a test compares against are written out by hand next to `DEFAULT_SEQUENCES`, not
derived from this module.
"""

from __future__ import annotations

import math
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
    ROOT_ATTR,
    SHARD_ATTR,
    bf16_to_bits,
    shard_name,
    shards_dir,
)
from common.store_files import record_shard_files

PAD_ID = 0


@dataclass
class Doc:
    """One stored document (or piece of a split one)."""

    source_index: int
    segments: list[tuple[list[int], bool]]  # (token ids, is loss)
    piece: int = 0

    @property
    def tokens(self) -> list[int]:
        return [t for ids, _ in self.segments for t in ids]

    @property
    def loss(self) -> list[int]:
        return [int(flag) for ids, flag in self.segments for _ in ids]


def _ids(start: int, count: int) -> list[int]:
    return [5 + (start + i) % 50 for i in range(count)]


# seq_len 16, 2 sequences per shard -> shard 0 holds sequences 0-1, shard 1 holds sequence 2.
# Hand counts: 3 sequences, 5 documents (4 source rows, one split in 2 pieces),
# tokens 14 + 16 + 13 = 43, loss tokens 5 + 2 + 14 + 6 + 7 = 34, padding 48 - 43 = 5.
DEFAULT_SEQUENCES: list[list[Doc]] = [
    [
        Doc(0, [(_ids(0, 4), False), (_ids(4, 5), True)]),  # 9 tokens, 5 loss
        Doc(1, [(_ids(9, 3), False), (_ids(12, 2), True)]),  # 5 tokens, 2 loss
    ],
    [Doc(2, [(_ids(20, 2), False), (_ids(22, 14), True)])],  # 16 tokens, 14 loss
    [
        Doc(2, [(_ids(36, 6), True)], piece=1),  # 6 tokens, 6 loss
        Doc(3, [(_ids(42, 7), True)]),  # plain text: 7 tokens, all loss
    ],
]


@dataclass
class FixtureStore:
    """Where a fixture store lives and what was put in it."""

    path: Path
    sequences: list[list[Doc]]
    seq_len: int
    sequences_per_shard: int
    attrs: dict[str, Any] = field(default_factory=dict)

    def shard_path(self, index: int) -> Path:
        return shards_dir(self.path) / shard_name(index)


def _root_attrs(
    sequences: list[list[Doc]],
    *,
    seq_len: int,
    sequences_per_shard: int,
    num_shards: int,
    tapped_layers: list[int],
    hidden_size: int,
    vocab_size: int,
    topk: int,
    full_logits: bool,
    tokenizer: str,
    complete: bool,
    format_version: int,
) -> dict[str, Any]:
    docs = [d for seq in sequences for d in seq]
    tokens = sum(len(d.tokens) for d in docs)
    attrs: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": format_version,
        "complete": complete,
        "created_by": {"dflash_offline": "0.1.0", "torch": torch.__version__, "zarr": "3"},
        "target": {
            "name_or_path": "fixture/tiny-target",
            "revision": "abc123",
            "model_type": "qwen3",
            "num_hidden_layers": 4,
            "config": {"model_type": "qwen3", "hidden_size": hidden_size},
        },
        "tokenizer": {
            "name_or_path": tokenizer,
            "vocab_size": vocab_size,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "eos_token_id": 2,
            "pad_token_id": PAD_ID,
            "mask_token_id": 3,
        },
        "tapped_layers": tapped_layers,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "topk": topk,
        "full_logits": full_logits,
        "hidden_dtype": "bfloat16",
        "sequences_per_shard": sequences_per_shard,
        "num_shards": num_shards,
        "dataset": {
            "path": "fixture.jsonl",
            "split": "train",
            "name": None,
            "format": "messages",
            "num_rows": len({d.source_index for d in docs}),
        },
        "extract_config": {"packing": {"seq_len": seq_len}, "target": {"dtype": "bfloat16"}},
        "content_key": "0" * 64,
    }
    if complete:
        attrs["counts"] = {
            "sequences": len(sequences),
            "documents": len(docs),
            "source_documents": len({d.source_index for d in docs}),
            "tokens": tokens,
            "loss_tokens": sum(sum(d.loss) for d in docs),
            "padding_tokens": len(sequences) * seq_len - tokens,
            "split_documents": len({d.source_index for d in docs if d.piece > 0}),
            "truncated_documents": 0,
            "dropped_tokens": 0,
        }
    return attrs


def _write_shard(
    folder: Path,
    index: int,
    sequences: list[list[Doc]],
    *,
    seq_len: int,
    num_tapped: int,
    hidden_size: int,
    vocab_size: int,
    topk: int,
    full_logits: bool,
    rng: np.random.Generator,
) -> None:
    n, s = len(sequences), seq_len
    arrays: dict[str, np.ndarray] = {
        "tokens": np.full((n, s), PAD_ID, np.int32),
        "loss_mask": np.zeros((n, s), np.uint8),
        "position_ids": np.zeros((n, s), np.int32),
        "document_ids": np.full((n, s), -1, np.int32),
    }
    doc_rows: list[tuple[int, int, int, int, int]] = []
    for row, seq in enumerate(sequences):
        start = 0
        for doc in seq:
            length = len(doc.tokens)
            span = slice(start, start + length)
            arrays["tokens"][row, span] = doc.tokens
            arrays["loss_mask"][row, span] = doc.loss
            arrays["position_ids"][row, span] = np.arange(length)
            arrays["document_ids"][row, span] = len(doc_rows)
            doc_rows.append((doc.source_index, doc.piece, row, start, length))
            start += length
        assert start <= s, "fixture sequence longer than seq_len"
    real = arrays["document_ids"] >= 0

    hidden = torch.randn(n, s, num_tapped, hidden_size).to(torch.bfloat16)
    hidden[torch.from_numpy(~real)] = 0
    arrays["hidden"] = bf16_to_bits(hidden)
    logits = torch.from_numpy(rng.standard_normal((n, s, vocab_size)).astype(np.float32) * 3)
    top = logits.topk(topk, dim=-1)
    arrays["target_argmax"] = logits.argmax(-1).numpy().astype(np.int32)
    arrays["topk_ids"] = top.indices.numpy().astype(np.int32)
    arrays["topk_logits"] = top.values.numpy()
    arrays["logsumexp"] = logits.logsumexp(-1).numpy()
    if full_logits:
        arrays["logits"] = bf16_to_bits(logits.to(torch.bfloat16))
    columns = list(zip(*doc_rows, strict=True))
    doc_dtypes = {"doc_source_index": np.int64, "doc_piece": np.int32, "doc_sequence": np.int32}
    doc_dtypes |= {"doc_start": np.int32, "doc_length": np.int32}
    for (name, dtype), column in zip(doc_dtypes.items(), columns, strict=True):
        arrays[name] = np.asarray(column, dtype=dtype)

    group = zarr.open_group(str(folder), mode="w", zarr_format=3)
    for name, data in arrays.items():
        chunks = (1, max(1, s // 2), *data.shape[2:]) if data.ndim >= 2 else data.shape
        out = group.create_array(
            name,
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            shards=data.shape,
            compressors=ZstdCodec(level=1),
        )
        out[...] = data
    docs = [d for seq in sequences for d in seq]
    group.attrs[SHARD_ATTR] = {
        "index": index,
        "num_sequences": n,
        "num_documents": len(docs),
        "num_tokens": int(real.sum()),
        "num_loss_tokens": int(arrays["loss_mask"].sum()),
        "split_documents": sum(d.piece > 0 for d in docs),
        "truncated_documents": 0,
        "dropped_tokens": 0,
    }
    record_shard_files(folder)  # FORMAT.md v2, as extract does


def build_store(
    path: str | Path,
    sequences: list[list[Doc]] | None = None,
    *,
    seq_len: int = 16,
    sequences_per_shard: int = 2,
    tapped_layers: list[int] | None = None,
    hidden_size: int = 8,
    vocab_size: int = 64,
    topk: int = 4,
    full_logits: bool = False,
    tokenizer: str = "fixture/no-such-tokenizer",
    committed: list[int] | None = None,
    format_version: int = FORMAT_VERSION,
    seed: int = 0,
) -> FixtureStore:
    """Write a FORMAT.md store holding `sequences` (default `DEFAULT_SEQUENCES`).

    `committed` lists the shards to write (default all, and the store is marked complete);
    a store with fewer is an extraction in progress. A temporary shard folder is always left
    next to the committed ones.
    """
    path = Path(path)
    sequences = DEFAULT_SEQUENCES if sequences is None else sequences
    tapped_layers = [1, 3] if tapped_layers is None else tapped_layers
    num_shards = math.ceil(len(sequences) / sequences_per_shard)
    committed = list(range(num_shards)) if committed is None else committed
    complete = committed == list(range(num_shards))
    attrs = _root_attrs(
        sequences,
        seq_len=seq_len,
        sequences_per_shard=sequences_per_shard,
        num_shards=num_shards,
        tapped_layers=tapped_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        topk=topk,
        full_logits=full_logits,
        tokenizer=tokenizer,
        complete=complete,
        format_version=format_version,
    )
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs[ROOT_ATTR] = attrs
    torch.manual_seed(seed)
    head = {
        "embed_tokens.weight": torch.randn(vocab_size, hidden_size).to(torch.bfloat16),
        "norm.weight": torch.ones(hidden_size, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(vocab_size, hidden_size).to(torch.bfloat16),
    }
    save_file(head, str(path / HEAD_FILE), metadata={"rms_norm_eps": "1e-06"})

    rng = np.random.default_rng(seed)
    shards_dir(path).mkdir(exist_ok=True)
    options = dict(
        seq_len=seq_len,
        num_tapped=len(tapped_layers),
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        topk=topk,
        full_logits=full_logits,
        rng=rng,
    )
    for index in committed:
        rows = sequences[index * sequences_per_shard : (index + 1) * sequences_per_shard]
        _write_shard(shards_dir(path) / shard_name(index), index, rows, **options)
    # A half-written shard of a crashed writer: garbage that readers must never open.
    pending = next((i for i in range(num_shards) if i not in committed), num_shards - 1)
    tmp = shards_dir(path) / f".tmp-{shard_name(pending)}-4242"
    tmp.mkdir()
    (tmp / "zarr.json").write_text("{ not json")
    return FixtureStore(path, sequences, seq_len, sequences_per_shard, attrs)
