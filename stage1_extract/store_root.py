"""The store's root during extraction: provenance attributes, the content key, resume checks and
the final commit of the counts (FORMAT.md, "Root attributes").

`prepare_store` runs once, before any shard is written (in the launching process, or rank 0):
it creates the root with `complete: false`, or checks that an existing store was written by the
same format version and the same content key (else refuses, naming `--overwrite`), and removes
the temporary folders of shards that were interrupted. `finalize_store` runs once after every
shard is committed: it sums the shards' own counts and sets `complete: true`.

`writer_lock` is held by one process of a run (the launching process, or rank 0) from before
`prepare_store` until after `finalize_store`: an OS lock (flock) on `STORE/.dflash-writer.lock`,
which the kernel releases when its holder dies, even by `kill -9`. A second `dflash extract` into
the same store is refused with the holder's pid and host; readers never take it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zarr

from common.config import runs_tf32
from common.durable import fsync_path
from common.locks import exclusive_lock
from common.logging import get_logger
from common.store import (
    HEAD_FILE,
    ROOT_ATTR,
    SHARD_ATTR,
    TMP_PREFIX,
    StoreError,
    committed_shards,
    open_store,
    read_root_attrs,
    shard_layout,
    shard_name,
    shards_dir,
)
from common.store_check import check_shards

# root attributes compared when the content key differs, to say what changed; paths as the
# key has them (`m/` and `./m` are the folder `m`)
_EXPLAINED = [
    (
        "target",
        lambda a: (_canonical_path(a["target"]["name_or_path"]), keyed_revision(a["target"])),
    ),
    ("target config", lambda a: a["target"]["config"]),
    (
        "tokenizer",
        lambda a: {
            k: _canonical_path(v) if k == "name_or_path" else v
            for k, v in a["tokenizer"].items()
            if k != "suffix_left_out"
        },
    ),
    # a store begun before extract left a tokenizer's appended EOS out of text rows has it in
    # its documents: the same settings and data, other tokens
    (
        "the tokenizer's appended end of sequence (this version leaves it out of text rows "
        "and prompts)",
        lambda a: a["tokenizer"].get("suffix_left_out"),
    ),
    ("tapped_layers", lambda a: a["tapped_layers"]),
    ("topk", lambda a: a["topk"]),
    ("full_logits", lambda a: a["full_logits"]),
    ("seq_len", lambda a: a["seq_len"]),
    ("sequences_per_shard", lambda a: a["sequences_per_shard"]),
    (
        "dataset",
        lambda a: (
            {k: a["dataset"][k] for k in ("split", "num_rows")}
            | {"path": _canonical_path(a["dataset"]["path"])}
            | {"name": None if is_local(a["dataset"]["path"]) else a["dataset"]["name"]}
        ),
    ),
    ("dataset format", lambda a: a["dataset"]["format"]),
    ("target dtype", lambda a: a["extract_config"]["target"]["dtype"]),
    ("target.matmul_precision", lambda a: matmul_precision(a["extract_config"]["target"])),
    ("hidden_dtype", lambda a: a["hidden_dtype"]),
]


def matmul_precision(target_cfg: dict[str, Any]) -> str:
    """The float32 matmul precision a store's target ran at: "high" (TF32) only for a float32
    target asked to (a bf16 target's matmuls are bf16 either way); stores from before the
    option ran at "highest"."""
    tf32 = runs_tf32(target_cfg.get("dtype"), target_cfg.get("matmul_precision"))
    return "high" if tf32 else "highest"


# data options that came after the first stores, with the defaults that leave the key as it was
LATER_DATA_DEFAULTS: dict[str, Any] = {
    "chat_template_kwargs": {},
    "prompt_field": "prompt",
    "completion_field": "completion",
}

# config sections whose keys are named one by one when they differ (`section.key: old -> new`,
# with the --set that gives the store's value back): prefix, the keys that decide the content,
# and the value a key had before it existed (a store from then records none)
_EXPLAINED_KEYS = [
    # besides the path (named by "dataset"); num_proc never decides the content
    (
        "data.",
        lambda a: {k: v for k, v in keyed_data(a["extract_config"]["data"]).items() if k != "path"},
        LATER_DATA_DEFAULTS,
    ),
    # not seq_len: named above
    (
        "packing.",
        lambda a: {k: v for k, v in a["extract_config"]["packing"].items() if k != "seq_len"},
        {"strategy": "next_fit"},  # the only packing before the option
    ),
    # not byte_shuffle: it changes codecs only, and shards of both kinds read alike
    (
        "store.",
        lambda a: {
            k: a["extract_config"]["store"][k] for k in ("chunk_tokens", "compression_level")
        },
        {},
    ),
]


def _canonical_path(name: str) -> str:
    """Absolute path for an existing local path (so `./m` and `/abs/m` agree), else as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def is_local(name: str) -> bool:
    """Whether a target or data path names something on this machine (read as it is: its
    target.revision or data.name goes unused), not a hub id."""
    return Path(name).expanduser().exists()


def keyed_revision(target: dict[str, Any]) -> str | None:
    """The target's revision as the key has it: None for a local folder, which transformers
    reads as it is whatever target.revision says (and which the weights fingerprint checks)."""
    return None if is_local(target["name_or_path"]) else target.get("revision")


def content_key(parts: dict[str, Any]) -> str:
    """sha256 of everything that decides the stored values, canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def keyed_data(data: dict[str, Any]) -> dict[str, Any]:
    """The data settings that decide the content. num_proc changes how fast rows are
    tokenized, never what is stored; options added since the first stores are left out at
    their defaults, so those stores still resume; data.name (a hub dataset's config) is
    null for a local file or folder, which never reads it."""
    keyed = {
        k: v
        for k, v in data.items()
        if k != "num_proc" and (k not in LATER_DATA_DEFAULTS or v != LATER_DATA_DEFAULTS[k])
    }
    if keyed.get("name") is not None and is_local(keyed["path"]):
        keyed["name"] = None
    return keyed


def key_parts(
    attrs: dict[str, Any], lengths_sha256: str, skipped: dict[str, int]
) -> dict[str, Any]:
    """What decides the content: the root attributes (without bookkeeping such as `complete`
    or `created_by`), the skipped rows and a digest of the tokenized documents' lengths."""
    cfg = attrs["extract_config"]
    data = keyed_data(cfg["data"])
    data["path"] = _canonical_path(data["path"])
    target = dict(attrs["target"], name_or_path=_canonical_path(attrs["target"]["name_or_path"]))
    if target.get("revision") is not None:
        target["revision"] = keyed_revision(attrs["target"])
    tokenizer = dict(
        attrs["tokenizer"], name_or_path=_canonical_path(attrs["tokenizer"]["name_or_path"])
    )
    parts = {
        # Version 2 only records file sizes, the stored values are those of version 1: the
        # key stays, so a version-1 store resumes (its new shards get the record)
        "format_version": 1,
        "target": target,
        "target_dtype": cfg["target"]["dtype"],
        "tokenizer": tokenizer,
        "data": data,
        "dataset": {k: attrs["dataset"][k] for k in ("format", "num_rows")},
        "skipped_rows": skipped,
        "document_lengths_sha256": lengths_sha256,
        # next-fit (the only packing before the option existed) leaves the key as it was, so
        # rerunning an older store's command with packing.strategy=next_fit still resumes it
        "packing": {
            k: v for k, v in cfg["packing"].items() if not (k == "strategy" and v == "next_fit")
        },
        "tapped_layers": attrs["tapped_layers"],
        "topk": attrs["topk"],
        "full_logits": attrs["full_logits"],
        "sequences_per_shard": attrs["sequences_per_shard"],
        "chunk_tokens": cfg["store"]["chunk_tokens"],
        "compression_level": cfg["store"]["compression_level"],
    }
    # Only when not bf16: bf16 stores written before the option existed keep their key, so
    # rerunning their command still resumes them.
    if attrs["hidden_dtype"] != "bfloat16":
        parts["hidden_dtype"] = attrs["hidden_dtype"]
    # likewise TF32 matmuls (other values, so another store) only when they ran
    if (precision := matmul_precision(cfg["target"])) != "highest":
        parts["matmul_precision"] = precision
    return parts


def earlier_key(parts: dict[str, Any], stored: dict[str, Any]) -> str:
    """The key of `parts` (this run's `key_parts`) as versions before local paths left
    target.revision and data.name out of it computed it, with the `stored` store's own values
    of those two where the path is local (a hub id's and a hub dataset's count as they are):
    a store begun then with either set resumes under any value, as a new one does."""
    target, data = dict(parts["target"]), dict(parts["data"])
    if is_local(target["name_or_path"]):
        target["revision"] = stored["target"].get("revision")
    if is_local(data["path"]):
        data["name"] = stored["extract_config"]["data"].get("name")
    return content_key({**parts, "target": target, "data": data})


def write_root_attrs(store: Path, attrs: dict[str, Any]) -> None:
    """Replace the "dflash" root attributes atomically (a kill never leaves half a zarr.json)."""
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc.setdefault("attributes", {})[ROOT_ATTR] = attrs
    tmp = store / f"{TMP_PREFIX}zarr.json-{os.getpid()}"
    with open(tmp, "w") as file:
        file.write(json.dumps(doc, indent=2))
        file.flush()
        # on disk before the rename: a power cut must not leave an empty zarr.json (file
        # systems may order the rename's metadata before the data)
        os.fsync(file.fileno())
    os.replace(tmp, meta)
    fsync_path(store)


# settings a rerun can set back to the store's value to resume it: label -> --set key
_SET_BACK = {
    "hidden_dtype": "store.hidden_dtype",  # its default: bf16, fp8 (13th session), nvfp4 (41st)
    "topk": "verifier.topk",
    "seq_len": "packing.seq_len",
    "sequences_per_shard": "store.sequences_per_shard",
    "target dtype": "target.dtype",
    "target.matmul_precision": "target.matmul_precision",  # configs/pystd.yaml turned it on
}


def _explain_mismatch(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, list[str]]:
    """What differs, and the `--set key=value` arguments that would give the store's settings
    back where that alone could resume it."""
    changed, set_back = [], []

    def shown(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value)

    for label, get in _EXPLAINED:
        try:
            if get(old) != get(new):
                if label not in _SET_BACK:
                    changed.append(label)
                    continue
                # by its --set key with both values, as the keys below (`hidden_dtype differ`
                # left out which encoding the store holds and which this run asked for)
                changed.append(f"{_SET_BACK[label]} ({get(old)!r} -> {get(new)!r})")
                set_back.append(f"--set {_SET_BACK[label]}={shown(get(old))}")
        except (KeyError, TypeError):
            changed.append(label)
    # each key of these sections by name, as `dflash generate` and `dflash train` name theirs
    # (the section alone, `extract_config.store`, left the user to find which key and value)
    for prefix, get, before in _EXPLAINED_KEYS:
        try:
            was, now = get(old), get(new)
        except (KeyError, TypeError):
            changed.append(prefix.rstrip("."))
            continue
        for key in sorted(was.keys() | now.keys()):
            missing = object()
            a, b = was.get(key, before.get(key, missing)), now.get(key, before.get(key, missing))
            if a == b:
                continue
            changed.append(
                f"{prefix}{key} ({'unset' if a is missing else repr(a)} -> "
                f"{'unset' if b is missing else repr(b)})"
            )
            if a is not missing:
                set_back.append(f"--set {prefix}{key}={shown(a)}")
    what = ", ".join(changed) if changed else _contents_changed(new)
    return what, set_back if len(set_back) == len(changed) else []


def _contents_changed(new: dict[str, Any]) -> str:
    """What differs when no setting does: the documents, and under truncation one cause that
    is no edit of the data: versions before `no_loss_tokens_after_truncation` kept the rows
    it skips (or refuses)."""
    if new["extract_config"]["packing"].get("overlong") != "truncate":
        return "the dataset contents (document lengths)"
    return (
        "the dataset contents (document lengths; or the store was begun by a version that "
        "kept rows whose first seq_len tokens hold no loss token, which this one skips as "
        "no_loss_tokens_after_truncation under packing.overlong=truncate)"
    )


# fingerprint -> what differs when it does (the error adds the way out: --overwrite)
_FINGERPRINTS = {
    "documents_sha256": "the tokenized documents differ (the data were edited, or the tokenizer "
    "or its chat template changed)",
    "target_weights_sha256": "the target's weights differ (its folder now holds other weights)",
}


def check_fingerprints(store: Path, stored: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume a store whose data or target weights changed under the same settings:
    new shards would silently mix with the old. Stores from before fingerprints resume as
    they did, unchecked. An import by `dflash convert` has none to check (its key names its
    input file's size and modification time), and is told nothing."""
    old, new = stored.get("fingerprints"), current.get("fingerprints")
    if new is None:
        return
    if old is None:
        get_logger().info(
            "store %s predates content fingerprints: the data and weights are not checked", store
        )
        return
    changed = [
        why
        for key, why in _FINGERPRINTS.items()
        if old.get(key) is not None and new.get(key) is not None and old[key] != new[key]
    ]
    if changed:
        raise StoreError(
            f"store {store} was written from other inputs under the same settings: "
            f"{'; '.join(changed)}. Resuming would mix shards of both; rerun with --overwrite "
            "to start over, or choose another --out"
        )


LOCK_FILE = ".dflash-writer.lock"


def _has_content(store: Path) -> bool:
    """Whether `store` exists with anything in it besides the writer lock file."""
    return store.is_dir() and any(p.name != LOCK_FILE for p in store.iterdir())


@contextmanager
def writer_lock(store: Path) -> Iterator[str]:
    """Hold the store's writer lock (see the module docstring), creating the folder if needed,
    yielding what this process wrote into the lock file: the run's other processes are handed
    it (`LockWatch`). StoreError naming the holder if another process holds it."""
    if _has_content(store):
        read_root_attrs(store)  # never put a lock file into a folder that is not a dflash store
    store.mkdir(parents=True, exist_ok=True)

    def refused(holder: str) -> StoreError:
        return StoreError(
            f"store {store} is being written by another `dflash extract` ({holder}); two "
            "writers would delete each other's shards: wait for that run to end (or stop "
            "it), then rerun this command to resume"
        )

    with exclusive_lock(store / LOCK_FILE, refused) as holder:
        yield holder


def prepare_store(
    store: Path, attrs: dict[str, Any], overwrite: bool, parts: dict[str, Any] | None = None
) -> list[int]:
    """Create the store or check it for resuming; return the shards already committed. The
    caller holds `writer_lock(store)`, so --overwrite never deletes a store another run writes.
    `parts`: the `key_parts` of `attrs["content_key"]`, to accept a store keyed before local
    paths left target.revision and data.name out (`earlier_key`)."""
    log = get_logger()
    if overwrite and _has_content(store):
        read_root_attrs(store)  # never delete a folder that is not a dflash store
        log.info("--overwrite: deleting %s", store)

        # zarr.json last, and each folder renamed aside before it is deleted: a run stopped
        # mid-way (deleting a large store takes minutes) leaves a store that a rerun deletes
        # or resumes, never a folder refused as not a store, nor a half-deleted shard. What an
        # earlier stop left aside goes first (a container may give this run the same pid).
        def order(entry: Path) -> tuple[bool, bool]:
            return entry.name == "zarr.json", not entry.name.startswith(TMP_PREFIX)

        for entry in sorted(store.iterdir(), key=order):
            if entry.name == LOCK_FILE:  # the lock this run holds stays
                continue
            if entry.is_dir() and not entry.is_symlink():
                aside = entry
                if not entry.name.startswith(TMP_PREFIX):
                    aside = store / f"{TMP_PREFIX}{entry.name}-{os.getpid()}"
                    entry.rename(aside)
                shutil.rmtree(aside)
            else:
                entry.unlink()
    if _has_content(store):
        info = open_store(store)  # format and version checks, with their own messages
        stored_key = info.attrs.get("content_key")
        if stored_key != attrs["content_key"] and (
            parts is None or stored_key != earlier_key(parts, info.attrs)
        ):
            what, set_back = _explain_mismatch(info.attrs, attrs)
            resume = f"; to resume it, rerun with {' '.join(set_back)}" if set_back else ""
            raise StoreError(
                f"store {store} was written with other settings or data ({what} differ)"
                f"{resume}; to replace it, rerun with --overwrite, or choose another --out"
            )
        check_fingerprints(store, info.attrs, attrs)
        for entry in shards_dir(store).glob(f"{TMP_PREFIX}*"):
            log.info("removing interrupted shard %s", entry.name)
            shutil.rmtree(entry, ignore_errors=True)
        for entry in store.glob(f"{TMP_PREFIX}*"):  # left by a stopped --overwrite or commit
            log.info("removing interrupted %s", entry.name)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        done = committed_shards(store)
        log.info("resuming %s: %d/%d shards committed", store, len(done), attrs["num_shards"])
        return done
    store.mkdir(parents=True, exist_ok=True)
    # not overwrite=True: zarr would delete the folder's contents, the held lock file included
    zarr.create_group(store, zarr_format=3, attributes={ROOT_ATTR: attrs})
    shards_dir(store).mkdir(exist_ok=True)
    return []


def _shard_attrs(store: Path, index: int) -> dict[str, Any]:
    meta = shards_dir(store) / shard_name(index) / "zarr.json"
    return json.loads(meta.read_text())["attributes"][SHARD_ATTR]


def finalize_store(
    store: Path, attrs: dict[str, Any], source_documents: int, skipped: dict[str, int]
) -> dict[str, Any]:
    """Sum the committed shards' counts into the root and mark the store complete."""
    done = committed_shards(store)
    missing = sorted(set(range(attrs["num_shards"])) - set(done))
    if missing or not (store / HEAD_FILE).is_file():
        raise StoreError(
            f"store {store}: cannot finalize, shards {missing[:10]} or {HEAD_FILE} are missing; "
            "rerun the same command to complete it"
        )
    # every shard's files against their recorded sizes and every array's metadata (JSON and
    # stat only; the layout's names do not depend on the counts): a rerun over a store whose
    # shard was cut since used to say "complete"
    info = open_store(store)
    check_shards(info, list(shard_layout(info, 0, 0)))
    shard_attrs = [_shard_attrs(store, i) for i in range(attrs["num_shards"])]

    def total(key: str) -> int:
        return sum(int(s[key]) for s in shard_attrs)

    sequences, tokens = total("num_sequences"), total("num_tokens")
    counts = {
        "sequences": sequences,
        "documents": total("num_documents"),
        "source_documents": source_documents,
        "tokens": tokens,
        "loss_tokens": total("num_loss_tokens"),
        "padding_tokens": sequences * attrs["seq_len"] - tokens,
        "split_documents": total("split_documents"),
        "truncated_documents": total("truncated_documents"),
        "dropped_tokens": total("dropped_tokens"),
    }
    if skipped:
        counts["skipped_rows"] = dict(skipped)
    final = dict(info.attrs, complete=True, counts=counts)
    write_root_attrs(store, final)
    return final
