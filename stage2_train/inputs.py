"""Checks of `dflash train`'s inputs, before any worker starts: the store, the drafter config,
and a run folder's checkpoints. One ValueError lists every problem found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from common.store import (
    HEAD_FILE,
    HIDDEN_DTYPES,
    StoreInfo,
    committed_shards,
    open_store,
    shard_name,
    shards_dir,
)
from stage2_train.config import TrainConfig
from stage2_train.model import DrafterShape, drafter_shape
from stage2_train.plan import split_store


def resolve_mask_token(cfg: TrainConfig, info: StoreInfo, embed_rows: int) -> int:
    """drafter.mask_token_id, else the tokenizer's mask token, else the first embedding row past
    the tokenizer's vocabulary, else a reserved special token, else the pad token."""
    tok = info.attrs.get("tokenizer", {})
    for candidate in (cfg.drafter.mask_token_id, tok.get("mask_token_id")):
        if candidate is not None:
            return int(candidate)
    if int(tok.get("vocab_size", embed_rows)) < embed_rows:
        return int(tok["vocab_size"])
    if tok.get("reserved_token_id") is not None:
        return int(tok["reserved_token_id"])
    if tok.get("pad_token_id") is not None:
        return int(tok["pad_token_id"])
    raise ValueError("no mask token: set drafter.mask_token_id (the store's tokenizer has none)")


def check_inputs(cfg: TrainConfig) -> tuple[StoreInfo, DrafterShape]:
    """Open the store and check the drafter config fits it; one ValueError lists every problem."""
    info = open_store(cfg.data.store, require_complete=True)
    split_store(info, cfg.data.holdout_sequences)
    with safe_open(str(Path(cfg.data.store) / HEAD_FILE), framework="pt") as f:
        embed_rows, embed_dim = f.get_slice("embed_tokens.weight").get_shape()
        head_rows, head_dim = f.get_slice("lm_head.weight").get_shape()
    problems = []
    D = info.hidden_size
    shards = committed_shards(info.path)
    hidden_meta = shards_dir(info.path) / shard_name(shards[0]) / "hidden" / "zarr.json"
    hidden_zarr = json.loads(hidden_meta.read_text())
    stored_KD = tuple(hidden_zarr["shape"][2:])
    bits = HIDDEN_DTYPES[info.hidden_dtype][0]
    if hidden_zarr["data_type"] != bits:
        problems.append(
            f"shard hidden arrays are {hidden_zarr['data_type']}, but the store's hidden_dtype "
            f"{info.hidden_dtype} is stored as {bits}; the store is inconsistent: re-extract it"
        )
    if stored_KD != (len(info.tapped_layers), D):
        problems.append(
            f"shard hidden arrays hold {stored_KD} = (K, D) per token, but the store lists "
            f"{len(info.tapped_layers)} tapped layers of width {D}; the store is inconsistent: "
            "re-extract it"
        )
    if (embed_dim, head_dim, head_rows) != (D, D, info.vocab_size):
        problems.append(
            f"{HEAD_FILE} holds embedding [{embed_rows}, {embed_dim}] and head "
            f"[{head_rows}, {head_dim}], but the store says hidden {D}, vocab {info.vocab_size}"
        )
    if cfg.drafter.hidden_size not in (None, D):
        problems.append(
            f"drafter.hidden_size={cfg.drafter.hidden_size} must equal the target's hidden size {D}"
            " (the drafter reads the target's embeddings and feeds its LM head)"
        )
    mask_id = resolve_mask_token(cfg, info, embed_rows)
    if not 0 <= mask_id < embed_rows:
        problems.append(f"mask_token_id {mask_id} is outside the embedding's {embed_rows} rows")
    if cfg.anchors.num_anchors * cfg.drafter.block_size > 64 * info.seq_len:
        problems.append("anchors.num_anchors * block_size is over 64x the sequence length")
    if problems:
        raise ValueError(
            f"drafter config does not fit store {info.path}:\n  - " + "\n  - ".join(problems)
        )
    config = info.attrs["target"]["config"]
    try:
        shape = drafter_shape(
            cfg.drafter, config, len(info.tapped_layers), info.vocab_size, mask_id
        )
    except ValueError as err:
        raise ValueError(f"drafter config does not fit store {info.path}: {err}") from err
    return info, shape


def check_same_run(
    meta: dict[str, Any], current: dict[str, Any], world: int, path: Path, store_key: str
) -> None:
    """Refuse to resume a checkpoint of another drafter or data (the run would be a hybrid), or
    one whose data position means other sequences (another world * batch * accum).

    The store is compared by its content key, not its path: a store re-extracted in place with
    other data is another store, and `./store` vs `/abs/store` is the same one.
    """
    saved = meta["config"]
    changed = [
        key
        for key in (
            "drafter",
            "anchors",
            "loss.target",
            "loss.gamma",
            "loss.distill_weight",
            "data.seed",
            "data.holdout_sequences",
            "optim.batch_sequences",
            "optim.grad_accum",
        )
        if _get(saved, key) != _get(current, key)
    ]
    if meta.get("store_content_key") != store_key:
        changed.append("data.store (its content key differs: another extraction)")
    if meta.get("world_size", world) != world:
        changed.append(f"world size ({meta['world_size']} processes, now {world})")
    if changed:
        raise ValueError(
            f"{path} was trained with other settings of {changed}; resume with the same config "
            "and devices, or pass a new --out"
        )


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree
