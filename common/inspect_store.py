"""`dflash inspect STORE`: what a store holds, where it came from, and what its tokens look like.

    dflash inspect STORE              human-readable summary
    dflash inspect STORE --json       the same as one JSON object
    dflash inspect STORE --sample 3   also decode 3 sequences, loss spans marked ⟦like this⟧
    dflash inspect verify STORE       check every shard (common/inspect_verify.py)

The summary reads only metadata (root and shard attributes, array shapes) and walks the folder
for disk usage, so it is instant on a store of any size. Counts are the sums over committed
shards, so they are right while an extraction is still running. A shard that cannot be read
(damaged metadata, a missing or truncated data file, an array of another dtype or shape) is
named, not fatal: the summary lists one whose metadata does not parse as unreadable, --sample
skips any of them with a warning; `inspect verify` says all that is wrong with it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from common.config import runs_tf32
from common.inspect_damage import Undecodable, missing_bytes, read_array
from common.inspect_verify import run_verify
from common.store import (
    FILES_KEY,
    SHARD_ATTR,
    TMP_PREFIX,
    StoreInfo,
    committed_shards,
    layout_mismatch,
    open_store,
    shard_layout,
    shard_name,
    shards_dir,
)
from common.store_files import file_problems

__all__ = ["disk_usage", "render_summary", "run_inspect", "run_verify", "sample_sequences"]

LOSS_OPEN, LOSS_CLOSE = "⟦", "⟧"
ANSI_LOSS, ANSI_RESET, ANSI_DIM = "\x1b[32m", "\x1b[0m", "\x1b[2m"
SAMPLED_ROWS = ("tokens", "loss_mask", "document_ids")  # per sequence, the rows shown
SAMPLED_DOCS = ("doc_source_index", "doc_piece")  # per document, named in each header


def disk_usage(path: Path, apparent: bool = False) -> int:
    """Bytes allocated under `path` as `du -s -B1` counts them (hard links once), or with
    `apparent` the sum of file sizes, which is what compression achieved without block slack."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, files in os.walk(path):
        # Every folder is visited once as its own "."; du counts folders' blocks too.
        for name in files if apparent else [".", *files]:
            stat = os.lstat(os.path.join(root, name))
            if (stat.st_dev, stat.st_ino) in seen:
                continue
            seen.add((stat.st_dev, stat.st_ino))
            # st_blocks is missing on some platforms; apparent size is the best guess there.
            blocks = getattr(stat, "st_blocks", stat.st_size // 512)
            total += stat.st_size if apparent else blocks * 512
    return total


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def summarize(info: StoreInfo) -> dict[str, Any]:
    """Counts, sizes and provenance of a store, as a JSON-ready dict."""
    attrs, seq_len = info.attrs, info.seq_len
    committed = committed_shards(info.path)
    tmp = [p.name for p in shards_dir(info.path).glob(TMP_PREFIX + "*")]
    totals = dict.fromkeys(["sequences", "documents", "tokens", "loss_tokens"], 0)
    arrays: dict[str, dict[str, Any]] = {}
    unreadable = []
    # a complete store's shard folder deleted, or a folder no plan wrote (train reads neither)
    planned = range(info.num_shards)
    missing = [shard_name(i) for i in planned if i not in committed] if info.complete else []
    outside = [shard_name(i) for i in committed if i not in planned]
    for index in committed:
        folder = shards_dir(info.path) / shard_name(index)
        try:
            group = zarr.open_group(str(folder), mode="r")
            shard = group.attrs[SHARD_ATTR]
            members = list(group.arrays())  # parses every array's metadata
        except Exception:  # zarr raises many types for damaged metadata; verify says which
            unreadable.append(shard_name(index))
            continue
        totals["sequences"] += shard["num_sequences"]
        totals["documents"] += shard["num_documents"]
        totals["tokens"] += shard["num_tokens"]
        totals["loss_tokens"] += shard["num_loss_tokens"]
        for name, array in members:
            row = arrays.setdefault(
                name, {"dtype": str(array.dtype), "uncompressed": 0, "stored": 0}
            )
            row["uncompressed"] += array.nbytes
            row["stored"] += disk_usage(folder / name, apparent=True)
    positions = totals["sequences"] * seq_len
    uncompressed = sum(a["uncompressed"] for a in arrays.values())
    stored = sum(a["stored"] for a in arrays.values())
    store_disk = disk_usage(info.path)
    target, tokenizer, dataset = attrs["target"], attrs["tokenizer"], attrs["dataset"]
    # how the target ran; a store converted from another trainer's files ran no target here
    converted = "converted_from" in attrs
    target_cfg = {} if converted else attrs.get("extract_config", {}).get("target", {})
    return {
        "store": str(info.path),
        "format": f"{attrs['format']} v{attrs['format_version']}",
        "format_version": attrs["format_version"],
        "complete": info.complete,
        "shards": {"planned": info.num_shards, "committed": len(committed), "being_written": tmp}
        | {"unreadable": unreadable, "missing": missing, "outside_plan": outside},
        **totals,
        "loss_share": _share(totals["loss_tokens"], totals["tokens"]),
        "padding_tokens": positions - totals["tokens"],
        "padding_share": _share(positions - totals["tokens"], positions),
        "bytes_on_disk": store_disk,
        "bytes_per_token": _share(store_disk, totals["tokens"]),
        "array_bytes_uncompressed": uncompressed,
        "array_bytes_stored": stored,
        "compression_ratio": _share(uncompressed, stored),
        "arrays": arrays,
        "counts": attrs.get("counts"),
        "provenance": {
            "target": {k: target.get(k) for k in ("name_or_path", "revision", "model_type")}
            | {"num_hidden_layers": target.get("num_hidden_layers")}
            # a local folder's weights (a hub id's are named by its revision): None for a hub id
            | {"weights_sha256": (attrs.get("fingerprints") or {}).get("target_weights_sha256")}
            # how it ran: stores written before matmul_precision existed ran at "highest"
            | {
                "dtype": target_cfg.get("dtype"),
                "matmul_precision": target_cfg.get("matmul_precision", "highest"),
            },
            "tokenizer": tokenizer.get("name_or_path"),
            "chat_template": tokenizer.get("chat_template") is not None,
            "tapped_layers": info.tapped_layers,
            "hidden_size": info.hidden_size,
            "hidden_dtype": info.hidden_dtype,
            "vocab_size": info.vocab_size,
            "seq_len": seq_len,
            "topk": info.topk,
            "full_logits": bool(attrs.get("full_logits")),
            "sequences_per_shard": attrs["sequences_per_shard"],
            "dataset": dataset,
            "generation": attrs.get("generation"),
            "created_by": attrs.get("created_by"),
            "content_key": attrs.get("content_key"),
        },
    }


def _target_name(target: dict[str, Any]) -> str:
    """The target as the store names it: its revision when one was given, its weights'
    fingerprint when a local folder (the "@ ?" that stood for neither read as damage)."""
    name = target["name_or_path"]
    if target.get("revision"):
        name += f" @ {target['revision']}"
    if target.get("weights_sha256"):
        name += f" (weights {target['weights_sha256'][:12]})"
    return name


def _tf32(target: dict[str, Any]) -> str:
    """A note when the target's float32 matmuls ran as TF32 (target.matmul_precision; a
    bf16 target's matmuls are bf16 whatever it says)."""
    tf32 = runs_tf32(target.get("dtype"), target.get("matmul_precision"))
    return " (TF32 matmuls)" if tf32 else ""


def _bytes(num: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def render_summary(s: dict[str, Any]) -> str:
    """The summary as an aligned two-column table."""
    shards, prov = s["shards"], s["provenance"]
    status = "complete" if s["complete"] else "IN PROGRESS"
    status += f": {shards['committed']}/{shards['planned']} shards committed"
    if shards["being_written"]:
        status += f", {len(shards['being_written'])} being written (ignored)"
    for key, label in (("missing", "MISSING"), ("outside_plan", "NOT IN THE PLAN")):
        if shards[key]:
            status += f"; {label}: {', '.join(shards[key])}"
    if shards["unreadable"]:
        status += f"; UNREADABLE: {', '.join(shards['unreadable'])}"
    if shards["unreadable"] or shards["missing"] or shards["outside_plan"]:
        status += " (run `dflash inspect verify`)"
    counts = s["counts"] or {}
    docs = f"{s['documents']:,}"
    if counts:
        docs += (
            f" ({counts['source_documents']:,} source rows, {counts['split_documents']:,} split,"
            f" {counts['truncated_documents']:,} truncated, {counts['dropped_tokens']:,} tokens"
            " dropped)"
        )
    target, data = prov["target"], prov["dataset"]
    rows = [
        ("store", s["store"]),
        ("format", s["format"]),
        ("status", status),
        ("sequences", f"{s['sequences']:,} x {prov['seq_len']:,} tokens"),
        ("documents", docs),
        ("tokens", f"{s['tokens']:,}"),
        ("loss tokens", f"{s['loss_tokens']:,} ({s['loss_share']:.1%} of tokens)"),
        ("padding", f"{s['padding_tokens']:,} ({s['padding_share']:.1%} of positions)"),
        ("on disk", f"{_bytes(s['bytes_on_disk'])} ({s['bytes_per_token']:,.1f} B/token)"),
        (
            "compression",
            f"{s['compression_ratio']:.2f}x ({_bytes(s['array_bytes_uncompressed'])} of arrays"
            f" stored in {_bytes(s['array_bytes_stored'])} of files)",
        ),
    ]
    for name, a in sorted(s["arrays"].items(), key=lambda kv: -kv[1]["stored"]):
        ratio = _share(a["uncompressed"], a["stored"])
        rows.append((f"  {name}", f"{a['dtype']:8} {_bytes(a['stored']):>10}  {ratio:.2f}x"))
    rows += [
        ("target", _target_name(target)),
        (
            "",
            f"{target['model_type']}, {target['num_hidden_layers']} layers"
            + (f", run in {target['dtype']}" if target.get("dtype") else "")
            + _tf32(target),
        ),
        (
            "tokenizer",
            f"{prov['tokenizer']} (chat template: {'yes' if prov['chat_template'] else 'no'})",
        ),
        (
            "tapped layers",
            f"{prov['tapped_layers']} (hidden size {prov['hidden_size']}, stored as "
            f"{prov['hidden_dtype']})",
        ),
        (
            "verifier",
            f"top-{prov['topk']} of {prov['vocab_size']:,}, full logits: {'yes' if prov['full_logits'] else 'no'}",
        ),
        ("dataset", f"{data.get('path')} [{data.get('name') or '-'}:{data.get('split')}]"),
        ("", f"format {data.get('format')}, {data.get('num_rows')} rows read"),
    ]
    if counts.get("skipped_rows"):
        rows.append(("skipped rows", json.dumps(counts["skipped_rows"])))
    rows += _generation_rows(prov.get("generation"))
    created = prov["created_by"] or {}
    rows.append(("created by", ", ".join(f"{k} {v}" for k, v in created.items()) or "?"))
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def _generation_rows(generation: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Where the data came from when `dflash generate` wrote them: the target that wrote
    them (and the server, through --endpoint), how it sampled, the ids its replies stop at,
    the source dataset and the totals."""
    if not generation:
        return []
    content = generation.get("content", {})
    target, sampling = content.get("target", {}), content.get("sampling", {})
    source, counts = generation.get("source", {}), generation.get("counts") or {}
    # the manifest's: the server of the run that wrote the first chunk (a resume through
    # another names its own in the folder's chunk-*.json, which the store does not copy)
    endpoint = (generation.get("backend") or {}).get("endpoint")
    server = f" at {endpoint} for the first chunk" if endpoint else ""
    how = (
        "greedy"
        if not sampling.get("temperature")
        else (f"temperature {sampling.get('temperature')}, top-p {sampling.get('top_p')}")
    )
    if sampling.get("temperature") and sampling.get("top_k"):  # absent or 0: every token
        how += f", top-k {sampling['top_k']}"
    if sampling.get("repetition_penalty", 1) != 1:  # greedy too
        how += f", repetition penalty {sampling['repetition_penalty']}"
    # a hub id or a server has no weights fingerprint: its name (and revision) says it
    weights = f", weights {target['weights_sha256'][:12]}" if target.get("weights_sha256") else ""
    # text windows write text.new_tokens each (the line below), whatever sampling.max_new_tokens
    limit = (
        "" if content.get("text") else f", max {sampling.get('max_new_tokens')} new tokens per turn"
    )
    rows = [
        ("generated by", f"{target.get('model')} ({content.get('backend')}{server}{weights})"),
        ("", f"{how}{limit}{_tf32(target)}"),
        ("", _stop_ids(generation.get("stop_ids"))),
    ]
    if content.get("text"):
        text = content["text"]
        rows.append(
            (
                "",
                f"text windows: {text['prompt_tokens']} prompt + {text['new_tokens']} new "
                f"tokens every {text['stride']}"
                # (absent: the default, a reply ends at the target's end of text)
                + (", written past the end of text" if text.get("stop_at_eos") is False else ""),
            )
        )
    rows.append(
        ("", f"from {source.get('path')} ({source.get('format')}, {source.get('num_rows')} rows)")
    )
    if counts:
        cut = counts.get("truncated") or 0
        ends = (
            f"{cut} windows of text.new_tokens, {(counts.get('prompts') or cut) - cut} ended sooner"
            if content.get("text")  # a window is meant to run to its length (run.py's _finalize)
            else f"{cut} replies cut at the limit"
            # (chat rows: absent where chunks of earlier versions do not record them)
            + (
                f", {counts['other_stops']} ended by another stop than the end of turn"
                if "other_stops" in counts
                else ""
            )
        )
        rows.append(
            (
                "",
                f"{counts.get('rows_out')} rows, {counts.get('new_tokens'):,} new tokens, "
                f"{ends}, skipped {json.dumps(counts.get('skipped') or {})}",
            )
        )
    if not generation.get("complete"):
        rows.append(("", "INCOMPLETE: generate had not finished when this store was extracted"))
    return rows


def _stop_ids(ids: list[int] | None) -> str:
    """The ids the target's replies stopped at, which chained_tau counts a reply's stop by
    (FORMAT.md `generation.stop_ids`); absent in stores of outputs from before the record."""
    if ids is None:
        return (
            "stop ids not recorded (generated before they were): chained_tau counts the "
            "tokenizer's and target config's end of sequence"
        )
    return f"replies stop at ids {ids}"


def _load_tokenizer(name: str | None) -> tuple[Any, str | None]:
    """The store's tokenizer, or None and why it could not be loaded."""
    if not name:
        return None, "the store records no tokenizer"
    from transformers import AutoTokenizer

    # The local cache first: asking the hub first would make an offline machine sit through
    # its retries, and the machine that extracted the store usually has the files.
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True), None
    except Exception:  # transformers raises OSError, ValueError, HTTP errors: all mean "no"
        pass
    try:
        return AutoTokenizer.from_pretrained(name), None
    except Exception as err:
        return None, f"tokenizer {name!r} could not be loaded ({type(err).__name__}: {err})"


def _documents(
    tokens: np.ndarray,
    loss: np.ndarray,
    doc_ids: np.ndarray,
    docs: dict[str, np.ndarray],
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """One sequence's documents, each split into runs of loss / no-loss tokens."""
    documents: list[dict[str, Any]] = []
    real = np.flatnonzero(doc_ids >= 0)
    cuts = np.flatnonzero(np.diff(doc_ids[real]) | np.diff(loss[real])) + 1
    for run in np.split(real, cuts) if real.size else []:
        doc = int(doc_ids[run[0]])
        if not documents or documents[-1]["document"] != doc:
            source, piece = docs["doc_source_index"][doc], docs["doc_piece"][doc]
            documents.append({"document": doc, "source_index": int(source), "piece": int(piece)})
            documents[-1] |= {"length": 0, "spans": []}
        ids = tokens[run].tolist()
        text = tokenizer.decode(ids) if tokenizer is not None else None
        documents[-1]["spans"].append({"loss": bool(loss[run[0]]), "token_ids": ids, "text": text})
        documents[-1]["length"] += len(ids)
    return documents


def _read_sampled(
    info: StoreInfo, folder: Path, rows: int
) -> tuple[dict[str, np.ndarray], str | None]:
    """The first `rows` sequences of the arrays a sample shows, and the document arrays whole;
    or what makes the shard unreadable. The arrays' dtypes and shapes and their data files are
    checked first, as verify checks them: an array of another length than `tokens` fails as an
    IndexError or shows other values, and zarr reads a missing file as zeros without an error
    (a sample of all token 0)."""
    try:
        group = zarr.open_group(str(folder), mode="r")
        arrays = {name: group[name] for name in (*SAMPLED_ROWS, *SAMPLED_DOCS)}
        layout = shard_layout(info, arrays["tokens"].shape[0], arrays["doc_source_index"].shape[0])
    except Exception as err:  # zarr raises many types for damaged metadata
        return {}, f"metadata unreadable ({type(err).__name__}: {err})"
    recorded = group.attrs.get(SHARD_ATTR, {}).get(FILES_KEY) or {}
    for name in arrays:
        if what := layout_mismatch(arrays[name], *layout[name]):
            return {}, f"{name}: {what}"
        if missing := missing_bytes(folder / name, name):
            return {}, f"{name}: {missing} (it would read as zeros)"
        own = {rel: size for rel, size in recorded.items() if rel.split("/")[0] == name}
        if found := file_problems(folder, own):
            return {}, f"{name}: {found[0][1]}"
    try:
        read = {name: read_array(arrays[name], np.s_[:rows]) for name in SAMPLED_ROWS}
        return read | {name: read_array(arrays[name], np.s_[:]) for name in SAMPLED_DOCS}, None
    except Undecodable as err:
        return {}, f"{err.array}: cannot decode ({type(err.err).__name__}: {err.err})"


def sample_sequences(
    info: StoreInfo, num_samples: int
) -> tuple[list[dict[str, Any]], str | None, list[dict[str, str]]]:
    """The first `num_samples` sequences split into documents and loss / no-loss spans.

    Returns the samples, a note when token ids are shown because no tokenizer loaded, and the
    shards skipped because they could not be read (shard, path, problem); the samples go on
    with the next shard, as the summary and verify go on past a damaged one.
    """
    tokenizer, note = _load_tokenizer(info.attrs["tokenizer"].get("name_or_path"))
    samples: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    per_shard = int(info.attrs["sequences_per_shard"])
    for index in committed_shards(info.path):
        if len(samples) >= num_samples:
            break
        folder = shards_dir(info.path) / shard_name(index)
        read, problem = _read_sampled(info, folder, num_samples - len(samples))
        if problem is not None:
            skipped.append({"shard": shard_name(index), "path": str(folder), "problem": problem})
            continue
        tokens, loss, doc_ids = read["tokens"], read["loss_mask"], read["document_ids"]
        for row in range(tokens.shape[0]):
            documents = _documents(tokens[row], loss[row], doc_ids[row], read, tokenizer)
            sequence = index * per_shard + row
            samples.append({"shard": index, "sequence": sequence, "documents": documents})
            samples[-1]["generated"] = bool(info.attrs.get("generation"))
            samples[-1]["padding"] = int((doc_ids[row] < 0).sum())
    return samples, note, skipped


def skipped_warnings(skipped: list[dict[str, str]], store: str | Path) -> list[str]:
    """One line per shard that --sample skipped: which, where, why, and the command that checks
    the whole store."""
    return [
        f"warning: skipped {s['shard']} ({s['path']}): {s['problem']}; run "
        f"`dflash inspect verify {store}` to check every shard"
        for s in skipped
    ]


def render_samples(samples: list[dict[str, Any]], note: str | None, color: bool) -> str:
    """Decoded samples; loss spans wrapped in ⟦ ⟧ (or green on a terminal)."""
    opened, closed = (ANSI_LOSS, ANSI_RESET) if color else (LOSS_OPEN, LOSS_CLOSE)
    dim = (lambda t: f"{ANSI_DIM}{t}{ANSI_RESET}") if color else (lambda t: t)
    lines = [f"note: {note}; showing token ids"] if note else []
    # a store of `dflash generate` output: its rows are the generated dataset's, whose own
    # `source_index` (in the generated files) names the original row
    row_name = "generated row" if samples and samples[0].get("generated") else "source row"
    for sample in samples:
        lines.append(f"=== sequence {sample['sequence']} (shard {sample['shard']}) ===")
        for doc in sample["documents"]:
            lines.append(
                dim(
                    f"--- document {doc['document']}: {row_name} {doc['source_index']},"
                    f" piece {doc['piece']}, {doc['length']} tokens ---"
                )
            )
            decoded = doc["spans"][0]["text"] is not None
            parts = []
            for span in doc["spans"]:
                body = span["text"] if decoded else " ".join(map(str, span["token_ids"]))
                parts.append(f"{opened}{body}{closed}" if span["loss"] else body)
            # Decoded text carries its own spacing; token ids need a separator.
            lines.append(("" if decoded else " ").join(parts))
        if sample["padding"]:
            lines.append(dim(f"--- padding: {sample['padding']} tokens ---"))
    return "\n".join(lines)


def run_inspect(store: str | Path, num_samples: int = 0, as_json: bool = False) -> None:
    """Print the summary of `store` (and `num_samples` decoded sequences) to stdout."""
    if num_samples < 0:
        raise ValueError(f"--sample must be >= 0, got {num_samples}")
    info = open_store(store)
    summary = summarize(info)
    samples, note, skipped = sample_sequences(info, num_samples) if num_samples else ([], None, [])
    if as_json:
        extra = {"samples": samples, "sample_note": note, "sample_skipped": skipped}
        print(json.dumps(summary | (extra if num_samples else {})))
        return
    print(render_summary(summary))
    if num_samples:
        print()
        for line in skipped_warnings(skipped, store):
            print(line)
        if num_samples > summary["sequences"]:  # all of them were decoded without a word
            print(
                f"note: --sample {num_samples} asks for more sequences than the store has "
                f"({summary['sequences']}): showing {len(samples)}"
            )
        print(render_samples(samples, note, color=sys.stdout.isatty()))
