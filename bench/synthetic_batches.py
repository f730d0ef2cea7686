"""Synthetic training batches for `bench/profile_train_step.py` (issue 12): the shapes it
profiles and packed sequences shaped like `StoreSequences`' items.

Each sequence packs documents of ~1/8 to ~3/10 of a sequence (the tail left as padding) with a
16-token prompt carrying no loss, random tokens and random bf16 features; anchors come from the
project's own sampling and block labels (`stage2_train.anchors`), and `stage2_train.data.collate`
makes the batches. Shapes: the pystd recipe's (configs/pystd.yaml: 16 x 2,560 tokens, three tapped layers), the
Qwen3-8B drafter's (configs/qwen3-8b.yaml; bench/shapes.py) and a tiny one for the CPU.

Imported by bench/profile_train_step.py (bench/ is on sys.path), which runs as
`python bench/profile_train_step.py --shape tiny --device cpu` (see there).
"""

from __future__ import annotations

from typing import Any

import torch
from shapes import PYSTD_28M, QWEN3_1_7B, QWEN3_4B, QWEN3_8B

from stage2_train.anchors import block_labels, pad_anchors, sample_anchors
from stage2_train.config import TrainConfig
from stage2_train.data import Batch, collate

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
# config file, target config, tapped layers, tokens per sequence, mask token id, extra settings
SHAPES: dict[str, tuple[str, dict, int, int, int, list[str]]] = {
    # the recipe's store since the eighteenth session: tapped layers [1, 4, 8], 2,560 tokens
    "pystd": ("configs/pystd.yaml", PYSTD_28M, 3, 2560, 3, []),
    "qwen3-8b": ("configs/qwen3-8b.yaml", QWEN3_8B, 5, 3072, 151669, []),
    # the 8B recipe's batch and drafter depth at the smaller Qwen3 widths
    "qwen3-1.7b": ("configs/qwen3-8b.yaml", QWEN3_1_7B, 5, 3072, 151669, []),
    "qwen3-4b": ("configs/qwen3-8b.yaml", QWEN3_4B, 5, 3072, 151669, []),
    "tiny": ("configs/debug.yaml", TINY, 2, 256, 3, ["optim.batch_sequences=2"]),
}
PROMPT = 16  # first tokens of each synthetic document carry no loss


def synthetic_item(
    seq_len: int, tapped: int, hidden: int, vocab: int, cfg: TrainConfig, gen: torch.Generator
) -> dict[str, Any]:
    """One sequence as StoreSequences.__getitem__ returns it (label target: the data tokens)."""
    lo, hi = max(PROMPT + 8, seq_len // 8), max(PROMPT + 16, seq_len * 3 // 10)
    document_ids_S = torch.full((seq_len,), -1, dtype=torch.long)
    position_ids_S = torch.zeros(seq_len, dtype=torch.long)
    loss_mask_S = torch.zeros(seq_len, dtype=torch.bool)
    start, doc = 0, 0
    while seq_len - start >= lo:  # packed documents, the tail left as padding
        length = min(int(torch.randint(lo, hi + 1, (), generator=gen)), seq_len - start)
        document_ids_S[start : start + length] = doc
        position_ids_S[start : start + length] = torch.arange(length)
        loss_mask_S[start + PROMPT : start + length] = True
        start, doc = start + length, doc + 1
    tokens_S = torch.randint(4, vocab, (seq_len,), generator=gen)
    num_anchors, block_size = cfg.anchors.num_anchors, cfg.drafter.block_size
    sampled_A = sample_anchors(loss_mask_S, document_ids_S, num_anchors, gen)
    anchors_A = pad_anchors(sampled_A, num_anchors)
    labels_AB, weights_AB = block_labels(
        anchors_A, tokens_S, loss_mask_S, document_ids_S, None, block_size
    )
    return {
        "index": 0,
        "tokens_S": tokens_S,
        "position_ids_S": position_ids_S,
        "document_ids_S": document_ids_S,
        "hidden_SKD": torch.randn(seq_len, tapped, hidden, generator=gen, dtype=torch.bfloat16),
        "anchors_A": anchors_A,
        "labels_AB": labels_AB,
        "weights_AB": weights_AB.float(),
        "damaged": None,
    }


def synthetic_batches(
    num_batches: int,
    seq_len: int,
    tapped: int,
    hidden: int,
    vocab: int,
    cfg: TrainConfig,
    pin: bool,
    rows_per_block: int | None = None,
) -> list[Batch]:
    """`num_batches` collated batches of cfg.optim.batch_sequences synthetic items each (one
    generator seeded 0: the same batches every run), pinned for a CUDA device; their mask
    tables for `rows_per_block` query rows a block (B * R with run.pack_heads)."""
    gen = torch.Generator().manual_seed(0)
    per_batch = cfg.optim.batch_sequences
    batches: list[Batch] = []
    for _ in range(num_batches):
        items = [synthetic_item(seq_len, tapped, hidden, vocab, cfg, gen) for _ in range(per_batch)]
        batch = collate(items, rows_per_block=rows_per_block)
        batches.append(batch.pin_memory() if pin else batch)
    return batches
