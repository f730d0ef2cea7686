"""`dflash convert IN.h5 STORE`: documents and hidden states from an HDF5 file (the layout of
hdf5_input.py) into a store that `dflash train` reads, written by extract's own code: the
packing plan (packing.py), the shard buffers and the verify-then-rename shard commit
(writer.py), the root attributes, writer lock, resume and final counts (store_root.py).

Verifier outputs (what `loss.target=argmax` trains on and what train and verify read in every
store) come from, in order:
- `input`: the file's /target_argmax, /topk_ids, /topk_logits, /logsumexp;
- `head`: computed with the target's LM head from the hidden states of its last decoder layer,
  when that layer is tapped (FORMAT.md: it is the output of the final norm, what the head reads);
- `data`: otherwise the next token of the same document, as a one-hot distribution (top-k of 1,
  logit 0, log-sum-exp 0). Training on it equals `loss.target=data` (both label each slot with
  the data's next token); a distillation term then distils the data, not the target. The root
  attribute `converted_from.verifier` records which one a store holds.

Shards are filled one at a time from the file (memory: one shard), so a rerun of the same
command resumes an interrupted import, as extract does.

Legend: L tokens of a piece, K tapped layers, D hidden size, V vocabulary, k top-k.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from common.config import to_dict
from common.logging import get_logger
from common.store import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEAD_FILE,
    StoreError,
    hidden_dtype_problem,
    open_store,
)
from common.target_config import text_config
from dflash_offline.convert.fill import ShardFiller
from dflash_offline.convert.hdf5_input import Hdf5Input, head_tensors, open_input, target_config
from stage1_extract.config import ExtractConfig
from stage1_extract.host_buffers import BufferShape, ShardBuffers
from stage1_extract.job import _version, reserved_token_id
from stage1_extract.packing import num_shards, plan_packing
from stage1_extract.store_root import (
    _canonical_path,
    _has_content,
    content_key,
    finalize_store,
    prepare_store,
    writer_lock,
)
from stage1_extract.target import config_dict, load_target_config, save_target_head
from stage1_extract.writer import ShardLayout, write_shard


@dataclass
class ImportOptions:
    """How to pack and store the file's documents; the store's other settings are extract's
    defaults (recorded in the store's `extract_config`)."""

    target: str | None = None  # model folder (config, tokenizer, head); else the file's attrs
    seq_len: int = 3072
    sequences_per_shard: int = 64
    packing: str = "best_fit"
    overlong: str = "split"
    topk: int = 32  # k of a top-k computed from the head (the file's own k otherwise)
    hidden_dtype: str = "bfloat16"
    overwrite: bool = False

    def problems(self) -> list[str]:
        out = [f"--seq-len must be >= 16, got {self.seq_len}"] if self.seq_len < 16 else []
        # each named with its value: one message for both named neither the culprit nor it
        out += [
            f"--{name.replace('_', '-')} must be >= 1, got {value}"
            for name in ("sequences_per_shard", "topk")
            if (value := getattr(self, name)) < 1
        ]
        return out


def _target(inp: Hdf5Input, target: str | None) -> dict[str, Any]:
    """The root attribute `target`, from the --target folder's config or the file's."""
    if target:
        cfg = ExtractConfig().target
        cfg.model = target
        config = load_target_config(cfg, "--target")
        if getattr(config, "dflash_config", None) is not None:  # as evaluate refuses one
            raise ValueError(
                f"--target {target} is a DFlash drafter export (dflash_config in its "
                "config.json), not a target: pass the model folder the hidden states came from"
            )
        full, text = config_dict(config), text_config(config)
        model_type, layers = config.model_type, text.num_hidden_layers
    elif (full := target_config(inp)) is not None:
        model_type = full.get("model_type")
        layers = getattr(text_config(full), "num_hidden_layers", None)
    else:
        raise ValueError(
            f"{inp.path}: no target: pass --target MODEL_FOLDER, or give the file a root "
            "attribute target (that folder) or target_config (the target's config as JSON) "
            "with a /target_head group"
        )
    if not isinstance(layers, int):
        raise ValueError(
            f"{inp.path}: the target's config has no num_hidden_layers; give the full config "
            "(save_pretrained's config.json) as target_config, or --target MODEL_FOLDER"
        )
    name = target or full.get("_name_or_path") or str(inp.path)
    attrs = {"name_or_path": name, "revision": None, "model_type": model_type}
    return attrs | {"num_hidden_layers": layers, "config": full}


def _tokenizer(inp: Hdf5Input, target: str | None, vocab: int) -> dict[str, Any]:
    """The root attribute `tokenizer`: from the tokenizer folder when one is named, else from
    the file's attributes (pad id: the pad, else EOS, else 0, as extract pads)."""
    name = inp.attrs.get("tokenizer") or target
    a = inp.attrs
    tok = {"name_or_path": name, "vocab_size": vocab, "chat_template": None}
    tok |= {k: a.get(k) for k in ("eos_token_id", "pad_token_id", "mask_token_id")}
    tok["reserved_token_id"] = a.get("reserved_token_id")
    if name:
        from transformers import AutoTokenizer

        try:
            loaded = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            raise ValueError(f"{inp.path}: cannot load the tokenizer {name} ({err})") from err
        template = loaded.chat_template
        tok |= {
            "vocab_size": len(loaded),
            "chat_template": template if isinstance(template, str) else None,
        }
        tok |= {"eos_token_id": loaded.eos_token_id, "pad_token_id": loaded.pad_token_id}
        tok |= {
            "mask_token_id": loaded.mask_token_id,
            "reserved_token_id": reserved_token_id(loaded),
        }
    if tok["pad_token_id"] is None:
        tok["pad_token_id"] = tok["eos_token_id"] if tok["eos_token_id"] is not None else 0
    return tok


def _write_head(inp: Hdf5Input, target: str | None, path: Path) -> None:
    """target_head.safetensors from /target_head, else from the target folder's weights."""
    tensors = head_tensors(inp)
    if tensors is not None:
        eps = inp.attrs.get("rms_norm_eps")
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"rms_norm_eps": str(eps)})
        os.replace(tmp, path)
        return
    if not target:
        raise ValueError(
            f"{inp.path}: no /target_head group and no target folder: give one of them (the "
            "embedding, final norm and LM head train needs)"
        )
    from transformers import AutoModelForCausalLM

    save_target_head(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), path)


def hdf5_to_store(h5: str | Path, store: str | Path, opts: ImportOptions) -> Path:
    """Import the HDF5 file `h5` into the store folder `store` (resumable); returns `store`.
    Everything is checked before the store folder is created or touched."""
    if problems := opts.problems():
        raise ValueError("dflash convert: " + "; ".join(problems))
    store = Path(store)
    # DEST first: a file there failed as 'File exists' and a folder of other files was told
    # to pass 'the folder extract wrote', both once the target's head had loaded
    if store.exists() and not store.is_dir():
        raise ValueError(f"DEST {store} is a file: an import writes a store folder; pass a new one")
    if _has_content(store) and not (store / "zarr.json").is_file():
        raise ValueError(
            f"DEST {store} holds other files and no store (no zarr.json): an import writes a "
            "new store folder or resumes its own; pass a new or empty folder"
        )
    inp = open_input(h5)
    if problem := hidden_dtype_problem(
        opts.hidden_dtype, inp.hidden_size, option="--hidden-dtype=", set_option="--hidden-dtype "
    ):
        inp.file.close()
        raise ValueError(f"{inp.path}: {problem}")
    # beside the store until prepare_store has checked or created it (it refuses a folder
    # holding anything but a store)
    head_file = store.parent / f".tmp-{store.name}-{HEAD_FILE}-{os.getpid()}"
    try:
        target = opts.target or inp.attrs.get("target")
        tattrs = _target(inp, target)
        store.parent.mkdir(parents=True, exist_ok=True)
        _write_head(inp, target, head_file)
        head_VD = _check_head(inp, head_file, tattrs["num_hidden_layers"])
        layers, V = tattrs["num_hidden_layers"], head_VD.shape[0]
        last = inp.tapped_layers.index(layers - 1) if layers - 1 in inp.tapped_layers else -1
        verifier = "input" if inp.verifier else "head" if last >= 0 else "data"
        topk = inp.topk if verifier == "input" else min(opts.topk, V) if verifier == "head" else 1
        if verifier == "data":
            get_logger().warning(
                "%s has no verifier outputs and does not tap the target's last layer (%d): "
                "target_argmax is the data's next token (what loss.target=data trains on), "
                "top-k a one-hot of it; add /target_argmax, /topk_ids, /topk_logits, "
                "/logsumexp, or tap layer %d, to store the target's own predictions",
                inp.path,
                layers - 1,
                layers - 1,
            )
        tok = _tokenizer(inp, target, V)
        plan = plan_packing(inp.lengths, opts.seq_len, opts.overlong, opts.packing)
        cfg = _extract_config(inp, store, opts, target, topk)
        attrs = _root_attrs(inp, cfg, tattrs, tok, V, num_shards(plan, opts.sequences_per_shard))
        attrs["converted_from"]["verifier"] = verifier
        attrs["content_key"] = content_key(_key(inp, opts, tattrs, verifier))
        fill = ShardFiller(
            inp,
            plan,
            opts.sequences_per_shard,
            tok,
            verifier,
            topk,
            last,
            head_VD,
            opts.overlong,
            opts.hidden_dtype,
        )
        with writer_lock(store):
            if not opts.overwrite:
                _check_resumable(store, attrs)
            done = set(prepare_store(store, attrs, opts.overwrite))
            os.replace(head_file, store / HEAD_FILE)
            _write_shards(store, cfg, fill, attrs["num_shards"], done)
            final = finalize_store(store, attrs, len(inp.lengths), {})
    finally:
        head_file.unlink(missing_ok=True)
        inp.file.close()
    get_logger().info("store %s complete: %s (verifier: %s)", store, final["counts"], verifier)
    return store


def _check_head(inp: Hdf5Input, head_file: Path, layers: int) -> torch.Tensor:
    """The LM head (fp32 [V, D]) once the head's shapes and the tapped layers fit /hidden."""
    with safe_open(str(head_file), framework="pt") as f:
        head_VD = f.get_tensor("lm_head.weight").float()
        embed = tuple(f.get_slice("embed_tokens.weight").get_shape())
        norm = tuple(f.get_slice("norm.weight").get_shape())
    D = inp.hidden_size
    if (head_VD.shape[1], embed[1], norm) != (D, D, (D,)):
        raise ValueError(
            f"{inp.path}: /hidden rows have D={D} values, but the target head holds embedding "
            f"{list(embed)}, norm {list(norm)}, lm_head {list(head_VD.shape)}; give the head "
            "of the target the hidden states came from"
        )
    if bad := [i for i in inp.tapped_layers if not 0 <= i < layers]:
        raise ValueError(
            f"{inp.path}: /hidden tapped_layers {bad} are not layers of the {layers}-layer "
            "target; give the ids of the decoder layers the hidden states came from"
        )
    return head_VD


def _extract_config(
    inp: Hdf5Input, store: Path, opts: ImportOptions, target: str | None, topk: int
) -> ExtractConfig:
    """The extract settings that would describe the store (its `extract_config` attribute)."""
    cfg = ExtractConfig()
    cfg.target.model, cfg.target.tapped_layers = target or "", inp.tapped_layers
    cfg.data.path, cfg.verifier.topk = str(inp.path), topk
    cfg.packing.seq_len, cfg.packing.overlong = opts.seq_len, opts.overlong
    cfg.packing.strategy = opts.packing
    cfg.store.out, cfg.store.hidden_dtype = str(store), opts.hidden_dtype
    cfg.store.sequences_per_shard = opts.sequences_per_shard
    return cfg


def _root_attrs(
    inp: Hdf5Input,
    cfg: ExtractConfig,
    tattrs: dict[str, Any],
    tok: dict[str, Any],
    vocab: int,
    shards: int,
) -> dict[str, Any]:
    """FORMAT.md's root attributes of the imported store (without its content key)."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "complete": False,
        "created_by": {"dflash_offline": _version("dflash-offline"), "torch": torch.__version__},
        "target": tattrs,
        "tokenizer": tok,
        "tapped_layers": inp.tapped_layers,
        "hidden_size": inp.hidden_size,
        "vocab_size": vocab,
        "seq_len": cfg.packing.seq_len,
        "topk": cfg.verifier.topk,
        "full_logits": False,
        "hidden_dtype": cfg.store.hidden_dtype,
        "sequences_per_shard": cfg.store.sequences_per_shard,
        "num_shards": shards,
        "dataset": {
            "path": str(inp.path),
            "split": None,
            "name": None,
            "format": "hdf5",
            "num_rows": len(inp.lengths),
        },
        "extract_config": to_dict(cfg),
        "converted_from": {"hdf5": _canonical_path(str(inp.path))},
    }


# the options an import records in its `extract_config`: flag -> (section, field)
_FLAGS = {
    "--hidden-dtype": ("store", "hidden_dtype"),
    "--seq-len": ("packing", "seq_len"),
    "--sequences-per-shard": ("store", "sequences_per_shard"),
    "--packing": ("packing", "strategy"),
    "--overlong": ("packing", "overlong"),
}


def _check_resumable(store: Path, attrs: dict[str, Any]) -> None:
    """Refuse a store imported otherwise in convert's own terms: extract's refusal
    (prepare_store) names `--set` keys and `--out`, which convert has not."""
    if not (store / "zarr.json").is_file():
        return
    old = open_store(store).attrs
    if old.get("content_key") == attrs["content_key"]:
        return
    if "converted_from" not in old:
        raise StoreError(
            f"store {store} was written by `dflash extract`, not imported: to replace it, "
            "rerun with --overwrite, or import into another folder"
        )
    config, now = old["extract_config"], attrs["extract_config"]
    differ = [
        (flag, config[section][field])
        for flag, (section, field) in _FLAGS.items()
        if config[section][field] != now[section][field]
    ]
    what = [f"{flag}: {value} there" for flag, value in differ]
    if _canonical_path(old["converted_from"]["hdf5"]) != _canonical_path(attrs["dataset"]["path"]):
        what.append(f"the input file: {old['converted_from']['hdf5']} there")
    elif not differ:
        what.append("the input file's contents, its --topk or --target")
    resume = ""
    if len(what) == len(differ):  # options alone: naming the store's values back resumes it
        resume = "; to resume it, rerun with " + " ".join(f"{f} {v}" for f, v in differ)
    raise StoreError(
        f"store {store} was imported with other options or data ({'; '.join(what)}){resume}; "
        "to replace it, rerun with --overwrite, or import into another folder"
    )


def _key(
    inp: Hdf5Input, opts: ImportOptions, tattrs: dict[str, Any], verifier: str
) -> dict[str, Any]:
    """What decides the store's content. The file's size and modification time stand for its
    contents (hashing every hidden state would cost a read of the file): a rewritten file is
    not resumed into."""
    stat = inp.path.stat()
    key = {"hdf5": _canonical_path(str(inp.path)), "bytes": stat.st_size}
    key |= {"mtime_ns": stat.st_mtime_ns, "target": tattrs, "verifier": verifier}
    return key | {k: v for k, v in vars(opts).items() if k not in ("overwrite", "target")}


def _write_shards(
    store: Path, cfg: ExtractConfig, fill: ShardFiller, shards: int, done: set[int]
) -> None:
    """Every shard not yet committed, one at a time through one reused set of buffers."""
    K, D = len(cfg.target.tapped_layers or []), fill.inp.hidden_size
    slots = cfg.store.sequences_per_shard * cfg.packing.seq_len
    shape = BufferShape(slots, K, D, cfg.verifier.topk, None, cfg.store.hidden_dtype)
    buffers = ShardBuffers.allocate(shape, False)
    layout = ShardLayout(
        cfg.packing.seq_len,
        cfg.store.chunk_tokens,
        cfg.store.compression_level,
        cfg.store.byte_shuffle,  # as extract does: the codecs the recorded extract_config names
    )
    try:
        for index in tqdm(range(shards), desc="import", unit="shard", disable=None):
            if index not in done:
                write_shard(store, fill.shard(index, buffers), buffers, layout)
    finally:
        buffers.release()
