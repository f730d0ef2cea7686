"""A training batch, and collate: the loader's items laid end to end as one packed context.

In a DataLoader worker every large tensor of a batch is allocated in shared memory, as
torch's own default_collate does (`shared_empty`): the worker's queue then hands the batch to
the training process as it is, where it would otherwise copy each tensor into shared memory
first (~100 MB a batch at 16 pystd sequences). The rows' hidden states arrive already laid end
to end in one such buffer (StoreSequences.__getitems__), so collate takes it without a copy.

Legend: S tokens per sequence, T = b*S context tokens of a batch, K tapped layers, D hidden
size, k top-k, A anchors, B block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from common.fp4 import Fp4Kind, round_features_fp4
from common.store import dequantize_fp8, encode_hidden
from stage2_train.mask_widths import narrow_widths
from stage2_train.masks import NARROW, TILE, MaskTables, anchor_mask_tables, context_intervals


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
    hidden_TKD: torch.Tensor  # bf16, or uint8 fp8 bits / nvfp4 rows with hidden_scale_TK
    anchors_A: torch.Tensor
    labels_AB: torch.Tensor
    weights_AB: torch.Tensor  # 0/1 validity of each slot's label (0 for padding items)
    topk_ids_ABk: torch.Tensor | None = None  # int32 (the store's), widened where used
    topk_logprobs_ABk: torch.Tensor | None = None
    hidden_scale_TK: torch.Tensor | None = None  # float32, fp8 and nvfp4 stores only
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

    def rounded_to_fp4(self, kind: Fp4Kind) -> Batch:
        """This batch as a store of 4-bit features would give it (`data.hidden_as_fp4`): the
        stored features (an fp8 store's decoded first) rounded as `kind`. nvfp4: the rows an
        nvfp4 store (store.hidden_dtype=nvfp4) would hold, decoded by the step as that store's
        are, so the two train alike in any dtype; mxfp4 (no such store): bf16 features, which
        hold its values exactly."""
        if self.hidden_scale_TK is None:
            features_TKD = self.hidden_TKD
        else:
            features_TKD = dequantize_fp8(self.hidden_TKD, self.hidden_scale_TK)
        if kind == "nvfp4":
            # extract's encoder, on a GPU compiled as extract's is there: eager, the six
            # block-scale candidates are ~180 elementwise passes over a batch's features
            rows_TKW, scale_TK = encode_hidden(features_TKD, "nvfp4", features_TKD.is_cuda)
            return replace(self, hidden_TKD=rows_TKW, hidden_scale_TK=scale_TK)
        rounded_TKD = round_features_fp4(features_TKD, kind).to(torch.bfloat16)
        return replace(self, hidden_TKD=rounded_TKD, hidden_scale_TK=None)

    def rounded_as_configured(self, hidden_as_fp8: bool, hidden_as_fp4: str) -> Batch:
        """The batch as `data.hidden_as_fp8` / `data.hidden_as_fp4` ask (at most one is on):
        the same rounding for the training steps and the held-out evaluation."""
        if hidden_as_fp8:
            return self.rounded_to_fp8()
        if hidden_as_fp4 != "none":
            return self.rounded_to_fp4(hidden_as_fp4)  # type: ignore[arg-type]
        return self

    def rounded_to_fp8(self) -> Batch:
        """This batch as an fp8 store would give it (`data.hidden_as_fp8`): bf16 hidden states
        quantized by extract's own encoder, on the batch's device; an fp8 batch as it is."""
        if self.hidden_scale_TK is not None:
            return self
        # on a GPU compiled, as extract encodes there: eager it is four passes every step
        bits_TKD, scale_TK = encode_hidden(
            self.hidden_TKD, "float8_e4m3fn", self.hidden_TKD.is_cuda
        )
        return replace(self, hidden_TKD=bits_TKD, hidden_scale_TK=scale_TK)


def rounding_note(hidden_as_fp8: bool, hidden_as_fp4: str) -> str:
    """The start-up line's words for a rounding option that is on: the run's figures are then
    another store's than the one it reads (a device log is all a reader has)."""
    if hidden_as_fp8:
        return ", features rounded to fp8 (data.hidden_as_fp8)"
    if hidden_as_fp4 != "none":
        return f", features rounded to {hidden_as_fp4} (data.hidden_as_fp4)"
    return ""


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


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor: in shared memory inside a DataLoader worker (what
    default_collate does), in ordinary memory elsewhere."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) (dim 0) into a `shared_empty` tensor; without a copy when the parts
    already lie end to end in one storage (rows decoded into one batch buffer)."""
    first = parts[0]
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    size = (sum(part.shape[0] for part in parts), *first.shape[1:])
    for part in parts:
        if not (
            part.is_contiguous()
            and part.dtype == first.dtype
            and part.shape[1:] == first.shape[1:]
            and part.untyped_storage().data_ptr() == ptr
            and part.storage_offset() == offset
        ):
            return torch.cat(parts, out=shared_empty(size, first.dtype))
        offset += part.numel()
    return torch.empty(0, dtype=first.dtype).set_(
        first.untyped_storage(), first.storage_offset(), size
    )


def collate(
    items: list[dict[str, Any]],
    mask_tables: bool = True,
    narrow: bool = NARROW,
    rows_per_block: int | None = None,
) -> Batch:
    """Lay the sequences end to end; shift anchors, make document ids batch-unique, and move
    every padding anchor (-1) behind the real ones, as the attention mask expects; then build
    that mask's tile tables (on CPU, in the loader's worker) unless `mask_tables` is False
    (the dense SDPA path reads no tables: it builds its mask from the anchors), cut to the
    static `narrow_widths` of this layout when `narrow` (default; DFLASH_NARROW_MASK=0: full).
    `rows_per_block`: the attention's query rows per block (B * R with `run.pack_heads`)."""
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
    # where each item's block rows land: one copy of each into the batch's tensor, or none
    # when no padding anchor lies before a real one (rows gathered into one batch buffer)
    rows_A = torch.arange(order_A.numel())
    place_A = torch.empty_like(order_A)
    place_A[order_A] = rows_A
    in_place = torch.equal(order_A, rows_A)
    place_parts = place_A.split([part.numel() for part in anchor_parts])
    document_ids_T = _cat(doc_parts)
    block_size = items[0]["labels_AB"].shape[1]
    tables = None
    if mask_tables:
        ctx_lo_A, ctx_hi_A = context_intervals(anchors_A, document_ids_T)
        widths = None
        if narrow:  # the bound relies on the layout made above: sequences side by side
            per_seq = items[0]["anchors_A"].numel()
            widths = narrow_widths(len(items), S, per_seq, block_size, TILE, rows_per_block)
        tables = anchor_mask_tables(
            ctx_lo_A,
            ctx_hi_A,
            document_ids_T.numel(),
            block_size,
            widths=widths,
            rows_per_block=rows_per_block,
        )

    def blocks(name: str) -> torch.Tensor:  # torch.cat(...)[order_A], in one copy at most
        first = items[0][name]
        if in_place:
            return _cat([item[name] for item in items])
        out = shared_empty((order_A.numel(), *first.shape[1:]), first.dtype)
        for item, place in zip(items, place_parts, strict=True):
            out.index_copy_(0, place, item[name])
        return out

    distill = "topk_ids_ABk" in items[0]
    scaled = "hidden_scale_SK" in items[0]
    return Batch(
        indices=torch.tensor([item["index"] for item in items]),
        tokens_T=_cat([item["tokens_S"] for item in items]),
        position_ids_T=_cat([item["position_ids_S"] for item in items]),
        document_ids_T=document_ids_T,
        hidden_TKD=_cat([item["hidden_SKD"] for item in items]),
        anchors_A=anchors_A,
        labels_AB=blocks("labels_AB"),
        weights_AB=blocks("weights_AB"),
        topk_ids_ABk=blocks("topk_ids_ABk") if distill else None,
        topk_logprobs_ABk=blocks("topk_logprobs_ABk") if distill else None,
        hidden_scale_TK=_cat([item["hidden_scale_SK"] for item in items]) if scaled else None,
        mask_tables=tables,
        damaged=tuple(item["damaged"] for item in items if item.get("damaged")),
    )
