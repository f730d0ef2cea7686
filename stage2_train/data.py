"""The stage-2 loader: packed sequences from the store's shards, with anchors and block labels.

Global sequence `g` lives in shard `g // sequences_per_shard`, row `g % sequences_per_shard`
(FORMAT.md), so the index is computed from the root attributes alone: no shard is opened before
a worker first reads from it, and each worker keeps the arrays it opened. Which sequences a rank
reads, in which order, is stage2_train.plan's business; a key names (sequence, epoch, padding).

A sequence whose bytes cannot be read (a chunk that fails to decode or to checksum, a file
missing or of another size than recorded at commit: zarr would read it as zeros) becomes a blank
item (no anchors, zero weights) that carries one line naming the shard, the array and the fix;
`DamageGuard` turns it into one StoreError in the training process (`data.on_damaged=error`),
however many loader workers there are, or logs and counts it (`skip`).

fp8 stores (FORMAT.md) travel as their uint8 bits plus the fp32 scales, and are decoded on the
training device (stage2_train/step.py): half the host-to-device bytes, no host CPU spent on it.
The attention mask goes the other way: collate builds its tile tables here, in the workers
(a few ms of CPU), so the training stream launches nothing to prepare it (masks.MaskTables).

Anchors of sequence g in epoch e come from a generator seeded by (seed, e, g), so a resumed run
samples exactly what the uninterrupted one would have. Padding items (plan.py) are real
sequences read normally whose loss weights are zeroed.

Legend: S tokens per sequence, T = b*S context tokens of a batch, K tapped layers, D hidden
size, k top-k, A anchors, B block size.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.sync import sync as zarr_sync

from common.logging import get_logger
from common.store import (
    HIDDEN_DTYPES,
    REEXTRACT,
    StoreError,
    StoreInfo,
    bits_to_bf16,
    sequence_array_specs,
    shard_name,
    shards_dir,
)
from common.store_files import file_problems, recorded_files
from stage2_train.anchors import (
    block_gather,
    block_labels,
    next_token_source,
    pad_anchors,
    sample_anchors,
)
from stage2_train.mask_widths import narrow_widths
from stage2_train.masks import NARROW, TILE, MaskTables, anchor_mask_tables, context_intervals
from stage2_train.plan import ItemKey
from stage2_train.stop import ignore_stop_signals

SEQUENCE_FIELDS = ("tokens", "loss_mask", "position_ids", "document_ids", "target_argmax", "hidden")
DISTILL_FIELDS = ("topk_ids", "topk_logits", "logsumexp")


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator that depends only on (seed, epoch, sequence index)."""
    tag = [seed, 0, epoch, index] if epoch >= 0 else [seed, 1, index]
    state = np.random.SeedSequence(tag).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


@dataclass
class Batch:
    """b packed sequences laid end to end as one context of T = b*S tokens.

    Documents never cross sequence boundaries, and a sequence's padding belongs to no document,
    so the concatenation is itself a valid packed context. Anchors index into T.
    """

    indices: torch.Tensor  # [b] global sequence indices (-1 for padding items)
    tokens_T: torch.Tensor
    position_ids_T: torch.Tensor
    document_ids_T: torch.Tensor  # unique per document across the batch, -1 on padding
    hidden_TKD: torch.Tensor  # bf16, or uint8 float8_e4m3fn bits when hidden_scale_TK is set
    anchors_A: torch.Tensor
    labels_AB: torch.Tensor
    weights_AB: torch.Tensor  # 0/1 validity of each slot's label (0 for padding items)
    topk_ids_ABk: torch.Tensor | None = None
    topk_logprobs_ABk: torch.Tensor | None = None
    hidden_scale_TK: torch.Tensor | None = None  # float32, fp8 stores only
    mask_tables: MaskTables | None = None  # the attention mask of anchors_A, built by collate
    damaged: tuple[str, ...] = ()  # one line per unreadable sequence, read as a blank item

    def pin_memory(self) -> Batch:
        return Batch(**{f.name: _apply(getattr(self, f.name), "pin_memory") for f in fields(self)})

    def to(self, device: torch.device) -> Batch:
        moved = {
            f.name: _apply(getattr(self, f.name), "to", device, non_blocking=True)
            for f in fields(self)
        }
        return Batch(**moved)


def batch_tensors(batch: Batch) -> Iterator[torch.Tensor]:
    """Every tensor a batch holds, those of its mask tables included."""
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, MaskTables):
            yield from value
        elif isinstance(value, torch.Tensor):
            yield value


def _apply(value: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    if isinstance(value, MaskTables):
        return MaskTables(*(_apply(t, method, *args, **kwargs) for t in value))
    return getattr(value, method)(*args, **kwargs) if isinstance(value, torch.Tensor) else value


class Damaged(Exception):
    """A sequence that cannot be read; the message names the shard, the array and the fix."""


class StoreSequences(torch.utils.data.Dataset):
    """Reads one sequence per key; opens a shard the first time one of its rows is read."""

    def __init__(
        self,
        info: StoreInfo,
        *,
        num_anchors: int,
        per_document: bool,
        block_size: int,
        label_target: str,
        distill: bool,
        seed: int,
    ) -> None:
        self.root = Path(info.path)
        self.per_shard = int(info.attrs["sequences_per_shard"])
        self.num_anchors, self.per_document = num_anchors, per_document
        self.block_size, self.label_target = block_size, label_target
        self.distill, self.seed = distill, seed
        self.scaled = HIDDEN_DTYPES[info.hidden_dtype][1]
        self.names = [*SEQUENCE_FIELDS, *(DISTILL_FIELDS if distill else ())]
        self.names += ["hidden_scale"] if self.scaled else []
        # what a blank item (a damaged sequence) is made of: zeros of each array's row shape
        specs = sequence_array_specs(info.hidden_dtype, False)
        self.blank_rows = {
            name: (specs[name][0], (info.seq_len, *map(info.dim, specs[name][1])))
            for name in self.names
        }
        self._shards: dict[int, dict[str, zarr.Array]] = {}
        self._files: dict[int, dict[str, int]] = {}  # recorded sizes of the files read

    def __getstate__(self) -> dict[str, Any]:
        # Workers open their own shard handles; never ship open ones across processes.
        return {**self.__dict__, "_shards": {}, "_files": {}}

    def _damaged(self, index: int, array: str, what: str) -> Damaged:
        folder = shards_dir(self.root) / shard_name(index)
        return Damaged(f"store {self.root}: {folder.name} array {array}: {what}; {REEXTRACT}")

    def _shard(self, index: int) -> dict[str, zarr.Array]:
        """The arrays this dataset reads from shard `index`, opened on first use and kept."""
        if index not in self._shards:
            path = shards_dir(self.root) / shard_name(index)
            if not path.is_dir():
                raise self._damaged(index, "-", f"shard folder {path} is missing")
            try:
                recorded = recorded_files(path) or {}  # {} for shards from before format v2
                group = zarr.open_group(path, mode="r", zarr_format=3)
            except Exception as err:  # zarr raises many types for damaged metadata
                raise self._damaged(
                    index, "-", f"unreadable ({type(err).__name__}: {err})"
                ) from err
            arrays = {}
            for name in self.names:
                try:
                    arrays[name] = group[name]
                except Exception as err:
                    what = f"unreadable ({type(err).__name__}: {err})"
                    raise self._damaged(index, name, what) from err
            self._shards[index] = arrays
            self._files[index] = {
                rel: size for rel, size in recorded.items() if rel.split("/")[0] in arrays
            }
        return self._shards[index]

    def _read(self, index: int) -> dict[str, np.ndarray]:
        """Row `index` of every array read; Damaged when its bytes cannot be trusted."""
        shard_index, row = divmod(index, self.per_shard)
        shard = self._shard(shard_index)
        arrays = {}
        for name, value in zip(shard, zarr_sync(_read_rows(shard.values(), row)), strict=True):
            if isinstance(value, Exception):  # checksum, codec, short-file errors: many types
                what = f"cannot be decoded ({type(value).__name__}: {value})"
                raise self._damaged(shard_index, name, what) from value
            arrays[name] = np.asarray(value)
        # after the read: a file deleted or cut since the pre-check read as zeros, silently
        folder = shards_dir(self.root) / shard_name(shard_index)
        if problems := file_problems(folder, self._files[shard_index]):
            raise self._damaged(shard_index, *problems[0][:2])
        return arrays

    def _blank(self) -> dict[str, np.ndarray]:
        rows = {name: np.zeros(shape, dtype) for name, (dtype, shape) in self.blank_rows.items()}
        rows["document_ids"] -= 1  # padding everywhere: no anchors, no labels
        return rows

    def read_row(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence `index` as tensors (hidden as bf16, or fp8 bits beside hidden_scale);
        Damaged when its bytes cannot be trusted."""
        arrays = self._read(index)
        hidden = arrays.pop("hidden")
        row = {name: torch.from_numpy(a) for name, a in arrays.items()}
        row["hidden"] = torch.from_numpy(hidden) if self.scaled else bits_to_bf16(hidden)
        return row

    def __getitem__(self, key: ItemKey) -> dict[str, Any]:
        index, epoch, is_pad = key
        damaged = None
        try:
            arrays = self._read(index)
        except Damaged as err:
            arrays, damaged, is_pad = self._blank(), str(err), True
        hidden = arrays.pop("hidden")
        hidden_SKD = torch.from_numpy(hidden) if self.scaled else bits_to_bf16(hidden)
        arrays = {name: torch.from_numpy(a) for name, a in arrays.items()}
        tokens_S = arrays["tokens"].long()
        loss_mask_S = arrays["loss_mask"].bool()
        document_ids_S = arrays["document_ids"].long()
        gen = anchor_generator(self.seed, epoch, index)
        sampled_A = sample_anchors(
            loss_mask_S, document_ids_S, self.num_anchors, gen, per_document=self.per_document
        )
        # A fixed anchor count (padding -1) keeps shapes static: compiled regions never recompile.
        anchors_A = pad_anchors(sampled_A, self.num_anchors)
        if self.label_target == "data":
            source_S = tokens_S
        else:  # stored argmax[t] predicts token t + 1: shift so index t labels token t
            source_S = next_token_source(arrays["target_argmax"].long())
        labels_AB, weights_AB = block_labels(
            anchors_A, tokens_S, loss_mask_S, document_ids_S, source_S, self.block_size
        )
        item = {
            "index": -1 if is_pad else index,
            "tokens_S": tokens_S,
            "position_ids_S": arrays["position_ids"].long(),
            "document_ids_S": document_ids_S,
            "hidden_SKD": hidden_SKD,
            "anchors_A": anchors_A,
            "labels_AB": labels_AB,
            "weights_AB": weights_AB.float() * (0.0 if is_pad else 1.0),
            "damaged": damaged,
        }
        if self.scaled:
            item["hidden_scale_SK"] = arrays["hidden_scale"]
        if self.distill:
            logprobs_Sk = arrays["topk_logits"] - arrays["logsumexp"][:, None]
            ids_Sk = next_token_source(arrays["topk_ids"].long())
            item["topk_ids_ABk"] = block_gather(anchors_A, ids_Sk, self.block_size)
            item["topk_logprobs_ABk"] = block_gather(
                anchors_A, next_token_source(logprobs_Sk), self.block_size
            )
        return item


def collate(items: list[dict[str, Any]], mask_tables: bool = True, narrow: bool = NARROW) -> Batch:
    """Lay the sequences end to end; shift anchors, make document ids batch-unique, and move
    every padding anchor (-1) behind the real ones, as the attention mask expects; then build
    that mask's tile tables (on CPU, in the loader's worker) unless `mask_tables` is False
    (the dense SDPA path reads no tables: it builds its mask from the anchors), cut to the
    static `narrow_widths` of this layout when `narrow` (default; DFLASH_NARROW_MASK=0: full)."""
    S = items[0]["tokens_S"].shape[0]
    doc_parts, anchor_parts, next_doc = [], [], 0
    for i, item in enumerate(items):
        docs_S = item["document_ids_S"]
        real_S = docs_S >= 0
        _, dense_S = torch.unique(docs_S[real_S], return_inverse=True)
        renumbered_S = torch.full_like(docs_S, -1)
        renumbered_S[real_S] = dense_S + next_doc
        next_doc += int(dense_S.max()) + 1 if real_S.any() else 0
        doc_parts.append(renumbered_S)
        anchors_A = item["anchors_A"]
        anchor_parts.append(torch.where(anchors_A >= 0, anchors_A + i * S, -1))
    anchors_A = torch.cat(anchor_parts)
    order_A = torch.argsort((anchors_A < 0).to(torch.int8), stable=True)
    anchors_A = anchors_A[order_A]
    document_ids_T = torch.cat(doc_parts)
    block_size = items[0]["labels_AB"].shape[1]
    tables = None
    if mask_tables:
        ctx_lo_A, ctx_hi_A = context_intervals(anchors_A, document_ids_T)
        widths = None
        if narrow:  # the bound relies on the layout made above: sequences side by side
            widths = narrow_widths(len(items), S, items[0]["anchors_A"].numel(), block_size, TILE)
        tables = anchor_mask_tables(
            ctx_lo_A, ctx_hi_A, document_ids_T.numel(), block_size, widths=widths
        )

    def blocks(name: str) -> torch.Tensor:
        return torch.cat([item[name] for item in items])[order_A]

    distill = "topk_ids_ABk" in items[0]
    scaled = "hidden_scale_SK" in items[0]
    return Batch(
        indices=torch.tensor([item["index"] for item in items]),
        tokens_T=torch.cat([item["tokens_S"] for item in items]),
        position_ids_T=torch.cat([item["position_ids_S"] for item in items]),
        document_ids_T=document_ids_T,
        hidden_TKD=torch.cat([item["hidden_SKD"] for item in items]),
        anchors_A=anchors_A,
        labels_AB=blocks("labels_AB"),
        weights_AB=blocks("weights_AB"),
        topk_ids_ABk=blocks("topk_ids_ABk") if distill else None,
        topk_logprobs_ABk=blocks("topk_logprobs_ABk") if distill else None,
        hidden_scale_TK=torch.cat([item["hidden_scale_SK"] for item in items]) if scaled else None,
        mask_tables=tables,
        damaged=tuple(item["damaged"] for item in items if item.get("damaged")),
    )


class DamageGuard:
    """A loader's batches, checked in the training process for damaged sequences: with
    on_damaged="error" the first one is raised as one StoreError line (not the worker's
    traceback); with "skip" each is logged and the blank item trains nothing."""

    def __init__(self, loader: torch.utils.data.DataLoader, on_damaged: str) -> None:
        self.loader, self.on_damaged = loader, on_damaged

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """Stop the loader's worker processes now. Persistent workers otherwise live until the
        loader is collected, and a run that stops with an error still holding it would wait
        on them at exit (they ignore SIGTERM: `init_loader_worker`)."""
        iterator = getattr(self.loader, "_iterator", None)  # where torch keeps the workers
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            self.loader._iterator = None

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.loader:
            if batch.damaged and self.on_damaged == "error":
                raise StoreError(
                    f"{batch.damaged[0]} (or set data.on_damaged=skip to train without it)"
                )
            for line in batch.damaged:
                get_logger().warning("skipped a damaged sequence: %s", line)
            yield batch


async def _read_rows(arrays: Iterable[zarr.Array], row: int) -> list[Any]:
    """Row `row` of each array, read concurrently in one trip to zarr's event loop (a row's
    ~10 arrays cost ~1-2 ms each in zarr's per-read overhead, one `array[row]` at a time: 23
    vs 29 ms a pystd row, bench/loader_cost.py); an array's error comes back as its value."""
    reads = (array.async_array.getitem(row) for array in arrays)
    return await asyncio.gather(*reads, return_exceptions=True)


def init_loader_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: signals left to the trainer (`ignore_stop_signals`), and
    CPython's own garbage collection: a worker forked inside the training loop inherits the
    trainer's disabled collector (stage2_train/gc_schedule.py), which nothing in the worker
    would ever collect for. Workers run at nice 10, as extraction's writers do: when they
    outnumber the free cores, the trainer's thread that queues the GPU's work and its
    pin-memory thread keep theirs."""
    ignore_stop_signals(worker_id)
    gc.enable()
    os.nice(10)


def make_loader(
    dataset: StoreSequences,
    sampler: torch.utils.data.Sampler[list[ItemKey]],
    num_workers: int,
    prefetch: int,
    pin_memory: bool,
    on_damaged: str = "error",
    mask_tables: bool = True,
) -> DamageGuard:
    """A DataLoader over `sampler`'s micro-batches (workers persist across epochs), behind a
    DamageGuard applying `on_damaged`; `mask_tables`: collate builds the flex mask's tables."""
    extra: dict[str, Any] = {}
    if num_workers > 0:
        extra = {"prefetch_factor": prefetch, "persistent_workers": True}
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(collate, mask_tables=mask_tables),
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=init_loader_worker if num_workers > 0 else None,
        **extra,
    )
    return DamageGuard(loader, on_damaged)
