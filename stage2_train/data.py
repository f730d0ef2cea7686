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

A worker fetches a batch's keys at once (`__getitems__`): each row's arrays are decoded straight
from the shard files (stage2_train/shard_rows.py), its hidden states and top-k blocks into one
buffer of the batch per tensor, in shared memory (stage2_train/batch.py), so neither collate nor
the hand-over to the training process copies them. fp8 stores (FORMAT.md) travel as their
uint8 bits plus the fp32 scales, and are decoded on the training device (stage2_train/step.py):
half the host-to-device bytes, no host CPU spent on it. Top-k ids likewise stay the store's
int32 (the loss widens them on the device).
The attention mask goes the other way: collate builds its tile tables here, in the workers
(a few ms of CPU), so the training stream launches nothing to prepare it (masks.MaskTables).

`layers` reads some of the store's tapped layers only (`data.tapped_layers`: what fewer layers
cost, measured from one store): their rows are decoded as stored, then the chosen layers copied
into the batch's buffers, which hold only those (one copy of each row's features in the worker).

Anchors of sequence g in epoch e come from a generator seeded by (seed, e, g), so a resumed run
samples exactly what the uninterrupted one would have. Padding items (plan.py) are real
sequences read normally whose loss weights are zeroed.

Legend: S tokens per sequence, T = b*S context tokens of a batch, K tapped layers, D hidden
size, k top-k, A anchors, B block size.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.logging import get_logger
from common.store import HIDDEN_DTYPES, StoreError, StoreInfo, bits_to_bf16, sequence_array_specs
from stage2_train.anchors import (
    block_labels,
    next_token_gather,
    next_token_source,
    pad_anchors,
    sample_anchors,
)
from stage2_train.batch import Batch, shared_empty
from stage2_train.batch import batch_tensors as batch_tensors  # re-exported
from stage2_train.batch import collate as collate  # re-exported
from stage2_train.plan import ItemKey
from stage2_train.shard_rows import Damaged, ShardRows
from stage2_train.stop import ignore_stop_signals

SEQUENCE_FIELDS = ("tokens", "loss_mask", "position_ids", "document_ids", "target_argmax", "hidden")
DISTILL_FIELDS = ("topk_ids", "topk_logits", "logsumexp")
# the batch buffers of the rows' features, by stored dtype (bf16 bits: viewed as bf16 after)
BUFFER_DTYPES = {"uint8": torch.uint8, "uint16": torch.int16, "float32": torch.float32}


def loader_arrays(hidden_dtype: str, distill: bool) -> list[str]:
    """The arrays of each shard that StoreSequences reads (train checks them before step 1)."""
    names = [*SEQUENCE_FIELDS, *(DISTILL_FIELDS if distill else ())]
    return names + (["hidden_scale"] if HIDDEN_DTYPES[hidden_dtype][1] else [])


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator that depends only on (seed, epoch, sequence index)."""
    seed %= 2**64  # SeedSequence takes no negative data.seed (torch's manual_seed wraps them so)
    tag = [seed, 0, epoch, index] if epoch >= 0 else [seed, 1, index]
    state = np.random.SeedSequence(tag).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def layer_index(info: StoreInfo, layers: list[int] | None) -> list[int] | None:
    """Where `layers` (target layer ids) sit among the store's tapped layers; None when they
    are all of them in the store's order (nothing to select). ValueError naming what the store
    holds when one is not there."""
    stored = info.tapped_layers
    if layers is None or list(layers) == stored:
        return None
    missing = [layer for layer in layers if layer not in stored]
    if missing or not layers or len(set(layers)) != len(layers):
        raise ValueError(
            f"data.tapped_layers {list(layers)}: the store {info.path} holds layers {stored}; "
            "choose distinct ones among them, or null for all"
        )
    return [stored.index(layer) for layer in layers]


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
        layers: list[int] | None = None,
    ) -> None:
        self.info, self.root = info, Path(info.path)
        # indices into the store's K of the layers read, None for all of them in store order
        self.layer_index = layer_index(info, layers)
        self.per_shard = int(info.attrs["sequences_per_shard"])
        self.num_anchors, self.per_document = num_anchors, per_document
        self.block_size, self.label_target = block_size, label_target
        self.distill, self.seed = distill, seed
        self.scaled = HIDDEN_DTYPES[info.hidden_dtype][1]
        self.names = loader_arrays(info.hidden_dtype, distill)
        # what a blank item (a damaged sequence) is made of: zeros of each array's row shape
        specs = sequence_array_specs(info.hidden_dtype, False)
        self.blank_rows = {
            name: (specs[name][0], (info.seq_len, *map(info.dim, specs[name][1])))
            for name in self.names
        }
        # what an item holds of the features: the chosen layers' rows
        self.out_rows = dict(self.blank_rows)
        if self.layer_index is not None:
            for name in ("hidden", "hidden_scale")[: 1 + self.scaled]:
                dtype, (S, _, *rest) = self.blank_rows[name]
                self.out_rows[name] = (dtype, (S, len(self.layer_index), *rest))
        self._shards: dict[int, ShardRows] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Workers open their own shard handles; never ship open ones across processes.
        return {**self.__dict__, "_shards": {}}

    def _shard(self, index: int) -> ShardRows:
        """The arrays this dataset reads from shard `index`, opened on first use and kept."""
        if index not in self._shards:
            self._shards[index] = ShardRows.open(self.info, index, self.names)
        return self._shards[index]

    def _read(self, index: int, into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Row `index` of every array read, those named in `into` decoded into its arrays (the
        batch's buffers); Damaged when its bytes cannot be trusted."""
        shard_index, row = divmod(index, self.per_shard)
        into = into or {}
        # a row buffer only for the arrays `into` does not hold (not a second hidden row a read)
        rows = {
            name: np.empty(shape, dtype)
            for name, (dtype, shape) in self.blank_rows.items()
            if name not in into
        }
        return self._shard(shard_index).read(row, rows | into)

    def _chosen_layers(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`arrays` with only the chosen layers of the features (all of them: as they are)."""
        if self.layer_index is None:
            return arrays
        features = {"hidden", "hidden_scale"}
        return {n: a[:, self.layer_index] if n in features else a for n, a in arrays.items()}

    def _blank(self, into: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = {name: np.zeros(shape, dtype) for name, (dtype, shape) in self.blank_rows.items()}
        for name, out in into.items():
            out[...] = 0
            rows[name] = out
        rows["document_ids"] -= 1  # padding everywhere: no anchors, no labels
        return rows

    def read_row(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence `index` as tensors (hidden as bf16, or uint8 beside hidden_scale);
        Damaged when its bytes cannot be trusted."""
        arrays = self._chosen_layers(self._read(index))
        hidden = arrays.pop("hidden")
        row = {name: torch.from_numpy(a) for name, a in arrays.items()}
        row["hidden"] = torch.from_numpy(hidden) if self.scaled else bits_to_bf16(hidden)
        return row

    def __getitems__(self, keys: list[ItemKey]) -> list[dict[str, Any]]:
        """The items of `keys` (what a loader worker fetches for one batch), each row's hidden
        states (and fp8 / nvfp4 scales) decoded, and its top-k blocks gathered, straight into one
        buffer of the batch per tensor, in shared memory in a worker: collate takes them whole
        (unless padding anchors must move), and the worker's queue ships them as they are."""
        shapes = {}
        for name in ("hidden", "hidden_scale")[: 1 + self.scaled]:
            dtype, shape = self.out_rows[name]
            shapes[name] = (BUFFER_DTYPES[dtype], shape)
        if self.distill:
            blocks = (self.num_anchors, self.block_size, self.blank_rows["topk_ids"][1][1])
            # ids stay the store's int32 up to the device (half the bytes of int64 in the
            # shared buffers and the copy); the loss widens them there
            shapes["topk_ids_ABk"] = (torch.int32, blocks)
            shapes["topk_logprobs_ABk"] = (torch.float32, blocks)
        buffers = {n: shared_empty((len(keys), *shape), t) for n, (t, shape) in shapes.items()}
        return [
            self._item(key, {n: b[i] for n, b in buffers.items()}) for i, key in enumerate(keys)
        ]

    def __getitem__(self, key: ItemKey) -> dict[str, Any]:
        return self.__getitems__([key])[0]

    def _item(self, key: ItemKey, into: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The item of `key`, its hidden states (and scales) read into `into`'s rows, its top-k
        blocks gathered into them."""
        index, epoch, is_pad = key
        damaged = None
        views = {n: into[n].numpy().view(self.blank_rows[n][0]) for n in into if n in self.names}
        # a subset of the layers is decoded whole into row buffers, then copied into `into`
        direct = views if self.layer_index is None else {}
        try:
            arrays = self._read(index, direct)
        except Damaged as err:
            arrays, damaged, is_pad = self._blank(direct), str(err), True
        if direct is not views:
            chosen = self._chosen_layers(arrays)
            for name, view in views.items():
                view[...] = chosen[name]
        del arrays["hidden"]
        hidden_SKD = into["hidden"] if self.scaled else into["hidden"].view(torch.bfloat16)
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
            item["hidden_scale_SK"] = into["hidden_scale"]
        if self.distill:
            logprobs_Sk = arrays["topk_logits"] - arrays["logsumexp"][:, None]
            ids_Sk = arrays["topk_ids"]  # int32
            for name, source_Sk in (("topk_ids_ABk", ids_Sk), ("topk_logprobs_ABk", logprobs_Sk)):
                item[name] = next_token_gather(anchors_A, source_Sk, self.block_size, into[name])
        return item


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
    rows_per_block: int | None = None,
) -> DamageGuard:
    """A DataLoader over `sampler`'s micro-batches (workers persist across epochs), behind a
    DamageGuard applying `on_damaged`; `mask_tables`: collate builds the flex mask's tables
    (for `rows_per_block` query rows a block: B * R with `run.pack_heads`)."""
    extra: dict[str, Any] = {}
    if num_workers > 0:
        extra = {"prefetch_factor": prefetch, "persistent_workers": True}
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=functools.partial(
            collate, mask_tables=mask_tables, rows_per_block=rows_per_block
        ),
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=init_loader_worker if num_workers > 0 else None,
        # each iterator draws its workers' base seed from this generator, not torch's global
        # RNG: a resume restores that RNG, then starts the iterator the uninterrupted run had
        # started at step 0 (workers draw nothing at random: anchors have their own generators)
        generator=torch.Generator(),
        **extra,
    )
    return DamageGuard(loader, on_damaged)
