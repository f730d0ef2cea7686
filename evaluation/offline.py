"""`dflash evaluate-offline`: the offline acceptance estimate of an exported drafter on a store.

Training reports the estimate on its held-out sequences; this runs the same `evaluate` over
EVERY sequence of any store the drafter fits (same target, same tapped layers), e.g. one
extracted from the prompts `dflash evaluate` measures online, so the offline and online
figures can be compared on the same text. Anchors are sampled like held-out sequences (fixed
seed stream, labels = the stored target argmax), so the result is deterministic.

Beside it, `chained_tau` follows the online chain of anchors over each response
(`evaluation/chained.py`): on a store of the target's own greedy continuation of the online
prompts (`dflash generate`, then `dflash extract`), it is the online tau computed offline;
`prompt_lookup_chained_tau` is prompt lookup's on the same responses (no model needed), so a
dev store of any size gives both sides of `dflash evaluate`'s comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from common.logging import get_logger
from common.store import open_store, rounded_dev_features_note
from common.store_check import check_shards
from evaluation.chained import chained_tau_on_store
from evaluation.heldout import evaluate
from stage2_train.anchors import slot_weights
from stage2_train.data import StoreSequences, collate, loader_arrays
from stage2_train.export import load_export, other_target, read_export_config, trained_for
from stage2_train.plan import EVAL_EPOCH
from stage2_train.step import load_frozen_head


@dataclass
class OfflineEvalConfig:
    drafter: str
    store: str
    device: str = "cpu"
    num_anchors: int = 512
    max_sequences: int | None = None
    chunk_tokens: int = 2048
    dtype: str = "float32"  # the drafter's compute dtype, as `dflash evaluate` runs it
    chain_batch: int = 8  # sequences per chained forward

    def validate(self) -> None:
        # named by their flags: --num-anchors 0 failed as an AssertionError deep in the anchor
        # sampler (a bug's exit), and --max-sequences 0 as a store with no sequences
        problems = [
            f"--{name.replace('_', '-')} must be >= 1, got {value}"
            for name in ("num_anchors", "max_sequences")
            if (value := getattr(self, name)) is not None and value < 1
        ]
        if problems:
            raise ValueError("invalid evaluate-offline settings: " + "; ".join(problems))


def check_fits(drafter_config: dict[str, Any], attrs: dict[str, Any], store: str) -> None:
    """The drafter must read layers the store holds (all of them, or some: a drafter trained
    with `data.tapped_layers`) and the target's vocabulary."""
    problems = []
    layers = drafter_config["dflash_config"]["target_layer_ids"]
    if not set(layers) <= set(attrs["tapped_layers"]):
        problems.append(
            f"the drafter reads layers {layers}, the store holds {attrs['tapped_layers']}"
        )
    if drafter_config["hidden_size"] != attrs["hidden_size"]:
        problems.append(
            f"hidden size {drafter_config['hidden_size']} vs the store's {attrs['hidden_size']}"
        )
    if drafter_config["vocab_size"] != attrs["vocab_size"]:
        problems.append(
            f"vocab {drafter_config['vocab_size']} vs the store's {attrs['vocab_size']}"
        )
    if problems:
        raise ValueError(
            f"drafter does not fit store {store}: "
            + "; ".join(problems)
            + " (extract the store with the drafter's target and tapped layers)"
        )


def run_offline_eval(cfg: OfflineEvalConfig) -> dict[str, Any]:
    """Per-slot accuracy and implied tau of the drafter over the store's sequences."""
    cfg.validate()
    info = open_store(cfg.store, require_complete=True)
    if note := rounded_dev_features_note(info, "--store"):
        get_logger().warning(note)
    drafter_config = read_export_config(cfg.drafter)
    check_fits(drafter_config, info.attrs, cfg.store)
    store_target = trained_for(info.attrs)
    if differs := other_target(
        drafter_config, store_target["name_or_path"], store_target["weights_sha256"]
    ):
        get_logger().warning(
            "--drafter %s was %s, the target of store %s: its figures are another target's",
            cfg.drafter,
            differs,
            cfg.store,
        )
    total = int(info.attrs["counts"]["sequences"])
    count = total if cfg.max_sequences is None else min(total, cfg.max_sequences)
    if count < 1:
        raise ValueError(f"store {cfg.store}: no sequences to evaluate")
    # the shards read, checked as train checks its store: a damaged sequence was blanked in the
    # random-anchor pass (figures without it) and then failed the chained pass as a bug (exit 1)
    per_shard = int(info.attrs["sequences_per_shard"])
    check_shards(info, loader_arrays(info.hidden_dtype, False), list(range(-(-count // per_shard))))
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    model = load_export(cfg.drafter).to(device, dtype).eval()
    head = load_frozen_head(cfg.store, device, dtype)
    shape = model.shape
    sequences = StoreSequences(
        info,
        num_anchors=cfg.num_anchors,
        per_document=False,
        block_size=shape.block_size,
        label_target="argmax",
        distill=False,
        seed=0,
        layers=drafter_config["dflash_config"]["target_layer_ids"],
    )
    # a bar each for the two passes: on a CPU the chained one took minutes for 4 sequences
    batches = tqdm(
        (collate([sequences[(index, EVAL_EPOCH, False)]]) for index in range(count)),
        total=count,
        desc="random anchors",
        unit="seq",
        dynamic_ncols=True,
    )
    metrics = evaluate(
        model,
        head,
        batches,
        block_size=shape.block_size,
        mask_token_id=shape.mask_token_id,
        backend="flex" if device.type == "cuda" else "sdpa",
        slot_weights_B=slot_weights(shape.block_size),
        chunk_tokens=cfg.chunk_tokens,
        device=device,
    )
    chained = chained_tau_on_store(
        model,
        head,
        info,
        max_sequences=count,
        batch_sequences=cfg.chain_batch,
        block_size=shape.block_size,
        mask_token_id=shape.mask_token_id,
        backend="flex" if device.type == "cuda" else "sdpa",
        chunk_tokens=cfg.chunk_tokens,
        device=device,
        prompt_lookup=True,
        layers=drafter_config["dflash_config"]["target_layer_ids"],
        progress=True,
    )
    return {
        "store": cfg.store,
        "drafter": cfg.drafter,
        "sequences": count,
        **metrics,
        **chained,
    }
