"""Checks of `dflash train`'s inputs, before any worker starts: the store, the drafter
config and the dev store (a run folder's checkpoints: resume.py). One ValueError lists every
problem found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from common.fp4 import BLOCK as FP4_BLOCK
from common.generated import META_DIR as GENERATE_META_DIR
from common.logging import get_logger
from common.store import (
    HEAD_FILE,
    StoreError,
    StoreInfo,
    committed_shards,
    open_store,
    rounded_dev_features_note,
    sequence_array_specs,
    shard_name,
    shards_dir,
)
from common.store_check import check_shards, damage_error, damaged_shards
from stage2_train.config import TrainConfig
from stage2_train.data import layer_index, loader_arrays
from stage2_train.export import target_identity, trained_for
from stage2_train.model import DrafterShape, drafter_shape
from stage2_train.plan import split_store

# A mask row this much smaller than a typical row is treated as empty (see resolve_mask_token).
MIN_MASK_ROW_NORM = 0.05


def resolve_mask_token(cfg: TrainConfig, info: StoreInfo, embed_VD: torch.Tensor) -> int:
    """The token id filling block slots 1..B-1, whose embedding row must not be (near) zero.

    Candidates in order: drafter.mask_token_id, the tokenizer's mask token, the first
    embedding row past the tokenizer's vocabulary, a mask-named or reserved special token
    (store attr reserved_token_id), the pad token. A candidate whose row norm is under
    MIN_MASK_ROW_NORM x the median row norm is skipped (an explicit id is refused): pad rows
    are often exactly zero (padding_idx), and a zero mask embedding makes every mask slot's
    first-layer query zero, so those slots attend uniformly and are indistinguishable, q_proj
    and k_proj get no gradient, and the drafter learns little beyond slot 1 (measured on
    pystd-28m, whose pad row is zero).
    """
    tok = info.attrs.get("tokenizer", {})
    rows = embed_VD.size(0)
    vocab = int(tok.get("vocab_size", rows))
    named = [
        ("drafter.mask_token_id", cfg.drafter.mask_token_id),
        ("the tokenizer's mask token", tok.get("mask_token_id")),
        ("the first row past the tokenizer's vocabulary", vocab if vocab < rows else None),
        ("the reserved special token", tok.get("reserved_token_id")),
        ("the pad token", tok.get("pad_token_id")),
    ]
    norms_V = torch.cat([rows_VD.float().norm(dim=-1) for rows_VD in embed_VD.split(16384)])
    floor = MIN_MASK_ROW_NORM * float(norms_V.median())
    skipped = []
    for what, candidate in named:
        if candidate is None:
            continue
        token = int(candidate)
        if not 0 <= token < rows:
            raise ValueError(f"{what} {token} is outside the embedding's {rows} rows")
        if float(norms_V[token]) > floor:
            return token
        if what == "drafter.mask_token_id":
            raise ValueError(
                f"drafter.mask_token_id {token}: its embedding row is (near) zero (norm "
                f"{float(norms_V[token]):.3g}, typical {float(norms_V.median()):.3g}), so every "
                "mask slot would look the same to the drafter; pick a token with a real "
                "embedding row that text never produces (a reserved or unused special token)"
            )
        skipped.append(f"{what} {token}")
    raise ValueError(
        "no usable mask token: "
        + (f"{', '.join(skipped)} have (near) zero embedding rows; " if skipped else "")
        + "set drafter.mask_token_id to a special token with a real embedding row that text "
        "never produces"
    )


def _read_head(path: Path) -> tuple[torch.Tensor, tuple[int, int]]:
    """The embedding and the LM head's shape from the store's head file; ValueError with the fix
    when it is missing, truncated or lacks a tensor (safetensors raises its own error type)."""
    fix = f"delete {path} and rerun the same `dflash extract` (it writes only that file again)"
    if not path.is_file():
        raise ValueError(f"{path} is missing; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            embed_VD = f.get_tensor("embed_tokens.weight")
            head_rows, head_dim = f.get_slice("lm_head.weight").get_shape()
            f.get_slice("norm.weight")
    except (SafetensorError, OSError, KeyError) as err:  # truncated, unreadable, incomplete
        raise ValueError(f"{path} is damaged ({type(err).__name__}: {err}); {fix}") from err
    return embed_VD, (head_rows, head_dim)


def _first_hidden_meta(info: StoreInfo, names: list[str]) -> dict:
    """The first committed shard's hidden-array metadata, or a StoreError naming what is gone
    (the file checks come later: this read must not die on an IndexError or a bare JSON error).
    In a complete store that error is `check_shards`' report of every damaged shard."""
    shards = committed_shards(info.path)
    if not shards:
        raise StoreError(
            f"store {info.path} has no committed shard ({shards_dir(info.path)} is empty or gone): "
            "rerun the same `dflash extract` to write them, or pass another --store"
        )
    meta = shards_dir(info.path) / shard_name(shards[0]) / "hidden" / "zarr.json"
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError) as err:
        if info.complete:
            check_shards(info, names)  # names this shard and any other, each once
        raise StoreError(
            f"{meta} cannot be read ({err}): delete that shard's folder and rerun the same "
            f"`dflash extract` (`dflash inspect verify {info.path}` lists any other damage)"
        ) from err


def check_inputs(cfg: TrainConfig) -> tuple[StoreInfo, DrafterShape]:
    """Open the store and check the drafter config fits it; one ValueError lists every problem."""
    out = Path(cfg.run.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder for the run (new or existing)")
    stores = [(cfg.data.store, "--store")]
    if cfg.data.dev_store:
        stores.append((cfg.data.dev_store, "data.dev_store"))
    for given, named in stores:
        store = Path(given).expanduser().resolve()
        if out.resolve() == store or store in out.resolve().parents:
            # checkpoints, metrics and the export would be written among the store's files
            raise ValueError(
                f"--out {out} is inside the store {given} ({named}); pass a run folder of its "
                "own, e.g. runs/NAME"
            )
    # --follow trains while extraction writes the store: its split comes later (follow.py)
    info = open_store(cfg.data.store, require_complete=not cfg.data.follow)
    if info.complete:
        split_store(info, cfg.data.holdout_sequences)
    embed_VD, (head_rows, head_dim) = _read_head(info.path / HEAD_FILE)
    embed_rows, embed_dim = embed_VD.shape
    problems = []
    D = info.hidden_size
    names = loader_arrays(info.hidden_dtype, cfg.loss.distill_weight > 0)
    hidden_zarr = _first_hidden_meta(info, names)
    stored_KD = tuple(hidden_zarr["shape"][2:])
    bits, (_, width) = sequence_array_specs(info.hidden_dtype, False)["hidden"]
    K_D = (len(info.tapped_layers), info.dim(width))
    if info.complete and (hidden_zarr["data_type"] != bits or stored_KD != K_D):
        # a damaged or foreign shard: the report of every damaged shard, as run_train gives it;
        # unless every shard disagrees with the root attributes (then they are at fault: below)
        bad = damaged_shards(info, names, list(range(info.num_shards)))
        if len(bad) < info.num_shards:
            raise damage_error(info, bad, info.num_shards)
    if hidden_zarr["data_type"] != bits:
        problems.append(
            f"shard hidden arrays are {hidden_zarr['data_type']}, but the store's hidden_dtype "
            f"{info.hidden_dtype} is stored as {bits}; the store is inconsistent: re-extract it"
        )
    if stored_KD != K_D:
        problems.append(
            f"shard hidden arrays hold {stored_KD} = (K, row) per token, but the store lists "
            f"{len(info.tapped_layers)} tapped layers of {K_D[1]} stored values (hidden size "
            f"{D}, {info.hidden_dtype}); the store is inconsistent: re-extract it"
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
    try:
        mask_id = resolve_mask_token(cfg, info, embed_VD)
    except ValueError as err:
        problems.append(str(err))
        mask_id = -1
    try:
        layer_index(info, cfg.data.tapped_layers)
    except ValueError as err:
        problems.append(str(err))
    fp4 = cfg.data.hidden_as_fp4
    rounding = "data.hidden_as_fp8=true" if cfg.data.hidden_as_fp8 else f"data.hidden_as_fp4={fp4}"
    if info.hidden_dtype == "nvfp4" and rounding != "data.hidden_as_fp4=none":
        # 4-bit features rounded again measure neither store: what the option is for is
        # measuring a store format from features finer than it
        problems.append(
            f"{rounding} rounds a store's features to another format, but this store holds "
            "nvfp4 features already: turn it off (train on what the store holds)"
        )
    elif fp4 != "none" and D % FP4_BLOCK[fp4]:
        # found here, not at the first step (after the model is built and compiled)
        problems.append(
            f"data.hidden_as_fp4={fp4} rounds blocks of {FP4_BLOCK[fp4]} features, and the "
            f"target's hidden size {D} is not a multiple: "
            + ("use nvfp4 (blocks of 16) or none" if D % 16 == 0 else "set it to none")
        )
    anchors, block = cfg.anchors.num_anchors, cfg.drafter.block_size
    if anchors * block > 64 * info.seq_len:
        # (a sequence has at most seq_len anchors: the rest of the budget is padding)
        problems.append(
            f"anchors.num_anchors={anchors} x drafter.block_size={block} = {anchors * block} "
            f"query tokens a sequence is over 64x the store's {info.seq_len}-token sequences: "
            f"lower anchors.num_anchors (at most {info.seq_len} anchors fit a sequence)"
        )
    if problems:
        raise ValueError(
            f"drafter config does not fit store {info.path}:\n  - " + "\n  - ".join(problems)
        )
    config = info.attrs["target"]["config"]
    try:
        shape = drafter_shape(
            cfg.drafter, config, len(trained_layers(cfg, info)), info.vocab_size, mask_id
        )
    except ValueError as err:
        raise ValueError(f"drafter config does not fit store {info.path}: {err}") from err
    return info, shape


def trained_layers(cfg: TrainConfig, info: StoreInfo) -> list[int]:
    """The target layers the drafter reads: `data.tapped_layers`, or all the store holds, in
    ascending order either way: servers concatenate them in forward order (a store whose
    target.tapped_layers were listed otherwise, which extract now refuses, is read reordered)."""
    layers = cfg.data.tapped_layers
    return sorted(info.tapped_layers) if layers is None else list(layers)


def open_dev_store(
    path: str, train_info: StoreInfo, layers: list[int], announce: bool = True
) -> StoreInfo:
    """The store `data.dev_store` names, checked against the training store: the same target
    (sizes, vocabulary and weights) and tokenizer (`_tokenizer_differences`), the `layers` the
    drafter reads (`trained_layers`: all the training store's, or `data.tapped_layers`; a dev
    store may hold more, as `dflash evaluate-offline`'s store may), and every shard whole (what
    chained tau reads); else an error naming data.dev_store, the training store and the fix.
    run_train calls it with the other input checks: at its first use (after the model is
    built) it came minutes late. `announce`: log the note on rounded features (the worker's
    second opening passes False: the launcher's check has said it)."""
    try:
        info = open_store(path, require_complete=True)
    except StoreError as err:
        folder = Path(path)
        if (folder / "zarr.json").is_file() or (folder / GENERATE_META_DIR).is_dir():
            raise StoreError(f"data.dev_store: {err}") from None  # its own fix already
        what = "is not a dflash store (no zarr.json)" if folder.exists() else "does not exist"
        raise StoreError(
            f"data.dev_store {path} {what}: pass a store of your dev prompts, written by "
            "`dflash generate --data DEV.jsonl --out GEN` then `dflash extract --data GEN "
            "--out STORE --set store.hidden_dtype=bfloat16` with the training target (README's "
            "evaluate-offline recipe), or "
            "leave data.dev_store unset"
        ) from None
    differ = []
    if not set(layers) <= set(info.tapped_layers):
        subset = layers != train_info.tapped_layers
        read = " read (data.tapped_layers)" if subset else ""
        differ.append(f"tapped_layers {info.tapped_layers} vs {layers}{read}")
    differ += [
        f"{k} {info.attrs.get(k)} vs {train_info.attrs.get(k)}"
        for k in ("hidden_size", "vocab_size")
        if info.attrs.get(k) != train_info.attrs.get(k)
    ]
    dev, train = _target_weights(info.attrs), _target_weights(train_info.attrs)
    if dev and train and dev[0] == train[0] and dev[1] != train[1]:
        # another model of the same shapes (a base beside its instruct twin): the dev figure
        # would score this drafter on another target's argmax
        names = [a["target"]["name_or_path"] for a in (info.attrs, train_info.attrs)]
        differ.append(f"target {names[0]} vs {names[1]} ({dev[0]} differ)")
    differ += _tokenizer_differences(info.attrs["tokenizer"], train_info.attrs["tokenizer"])
    if differ:
        target, tokenizer = (train_info.attrs[k]["name_or_path"] for k in ("target", "tokenizer"))
        raise ValueError(
            f"data.dev_store {path} does not match the training store {train_info.path} "
            f"({'; '.join(differ)}): extract it with the same target, tokenizer and "
            f"target.tapped_layers as the training store (target {target}, tokenizer "
            f"{tokenizer}), or leave data.dev_store unset"
        )
    try:
        check_shards(info, loader_arrays(info.hidden_dtype, False))  # chained tau's arrays
    except StoreError as err:
        raise StoreError(f"data.dev_store: {err}") from None
    if announce and (note := rounded_dev_features_note(info, "data.dev_store")):
        get_logger().warning(note)
    return info


# what a store records of its tokenizer besides its size (FORMAT.md `tokenizer`)
TOKENIZER_RECORD = ("eos_token_id", "pad_token_id", "mask_token_id", "reserved_token_id")


def _tokenizer_differences(dev: dict[str, Any], train: dict[str, Any]) -> list[str]:
    """How the dev store's tokenizer record differs from the training store's: its size, and
    where both stores name their tokenizer, its special ids and chat template (the same size
    held other tokenizers: a base model's beside its instruct twin's, which differ in end of
    sequence and template). A store that names none (converted from HDF5 without a tokenizer:
    ids as the file gave them, no template) is compared by size alone, as is an id that one
    store does not record (reserved_token_id, missing in older stores)."""
    if dev.get("vocab_size") != train.get("vocab_size"):
        return [f"tokenizer of {dev.get('vocab_size')} vs {train.get('vocab_size')} tokens"]
    if not (dev.get("name_or_path") and train.get("name_or_path")):
        return []
    what = [
        f"{key} {dev[key]} vs {train[key]}"
        for key in TOKENIZER_RECORD
        if key in dev and key in train and dev[key] != train[key]
    ]
    if dev.get("chat_template") != train.get("chat_template"):
        what.append("chat templates differ")
    if not what:
        return []
    return [f"tokenizer {dev['name_or_path']} vs {train['name_or_path']} ({', '.join(what)})"]


def _target_weights(attrs: dict[str, Any]) -> tuple[str, str] | None:
    """What a store's target is known by (`target_identity`); None for a store from before
    fingerprints."""
    if not isinstance(attrs.get("fingerprints"), dict):
        return None
    return target_identity(**trained_for(attrs))
