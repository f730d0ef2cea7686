"""Attention of the drafter: compiled flex_attention as its own region, or dense SDPA.

`BlockAttention` prepares the anchor-block mask of one packed sequence once (per step, shared
by every layer) and then runs ``attention(q, k, v)`` for each layer. In training the mask's
tile tables come with the batch (built on CPU by the loader's workers, stage2_train/data.py),
so preparing the flex mask launches nothing on the device:

- ``flex`` (default on CUDA): ``block_attention``, i.e. flex_attention compiled as its own
  region (``torch.compile(dynamic=False, fullgraph=True)`` behind ``torch.compiler.disable``,
  so it is one small graph called from eager code whatever else is compiled). Eager flex
  materialises the whole score matrix (8.9 GB forward at the yardstick shape), so the region
  raises instead of ever running unfused: after a graph break, a recompile limit hit,
  ``TORCHDYNAMO_DISABLE`` or any other fallback to the Python frame.
- ``sdpa`` (default on CPU, where flex has no backward): F.scaled_dot_product_attention with
  the same mask materialised densely from the same mask_mod.

Shapes are fixed per run (context S, A anchors padded to the budget), so the region compiles
once per shape; a new mask each step enters as tensors and does not recompile.

Legend: H query heads, G key/value heads, Q = A*B query tokens, KV = S + Q keys, E head dim,
R = H/G query heads per key/value head, P = Q*R packed query rows (`pack_heads`).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from stage2_train import flex_tiles
from stage2_train.masks import (
    TILE,
    MaskTables,
    anchor_block_mask,
    anchor_block_mask_mod,
    block_mask_from_tables,
    context_intervals,
)

Backend = Literal["auto", "flex", "sdpa"]

_UNFUSED = (
    "flex_attention is about to run eagerly (unfused: it would materialise the full "
    "Q x KV score matrix). The compiled region fell back to Python: a graph break, the Dynamo "
    "recompile limit (shapes changing every step? pad anchors to a fixed budget), "
    "TORCHDYNAMO_DISABLE, or compile unavailable. Fix the cause, or use backend='sdpa'."
)


def _flex_region(q_1HQE: Tensor, k_1GKE: Tensor, v_1GKE: Tensor, block_mask: BlockMask) -> Tensor:
    # Constant-folded to False while Dynamo traces; True only if the frame runs in Python.
    if not torch.compiler.is_compiling():
        raise RuntimeError(_UNFUSED)
    options = flex_tiles.forward_options(q_1HQE, block_mask.BLOCK_SIZE)  # static while tracing
    return flex_attention(
        q_1HQE, k_1GKE, v_1GKE, block_mask=block_mask, enable_gqa=True, kernel_options=options
    )


_compiled_flex_region = torch.compile(_flex_region, dynamic=False, fullgraph=True)


def _layout_from_env() -> str:
    """How q/k/v reach the flex kernel: contiguous heads-major (default, `heads_major`), or
    DFLASH_FLEX_LAYOUT=tokens, as the layers' projections write them (`tokens_major`). On an
    H200 (BENCHMARKS.md, twenty-fourth session; two processes a layout, one call) the seed
    shape's forward + backward took 0.857 and 0.809 ms heads-major against 1.173 and 1.002 ms
    tokens-major, and the pystd step 70.4 and 71.5 ms against 72.4 and 72.7 ms, the copies
    heads-major costs included (q/k/v made contiguous, 24 a step at 8 layers, and the output's
    reshape for o_proj): the kernels read strided tokens-major tiles more slowly than those
    copies cost."""
    value = os.environ.get("DFLASH_FLEX_LAYOUT", "heads")
    if value not in ("tokens", "heads"):
        raise ValueError(f"DFLASH_FLEX_LAYOUT must be tokens or heads, got {value!r}")
    return value


FLEX_LAYOUT = _layout_from_env()


@torch.compiler.disable
def block_attention(
    q_1HQE: Tensor, k_1GKE: Tensor, v_1GKE: Tensor, block_mask: BlockMask
) -> Tensor:
    """Fused flex_attention under ``block_mask`` (GQA: H a multiple of G); scale 1/sqrt(E).

    The disable decorator makes an enclosing torch.compile break the graph here, so this
    region keeps its own options and graph cache instead of being inlined. Inputs are brought
    to one layout (FLEX_LAYOUT: heads-major unless DFLASH_FLEX_LAYOUT=tokens) because the
    static graph guards on strides: a caller passing transposed views one time and contiguous
    tensors another would otherwise recompile. The output has the query's layout (flex's
    lowering matches it).
    """
    if q_1HQE.is_cuda and block_mask.BLOCK_SIZE[0] < 128:
        flex_tiles.install()  # inductor's default kernel tiles do not divide 64-token tiles
    q_1HQE, k_1GKE, v_1GKE = flex_layout(q_1HQE), flex_layout(k_1GKE), flex_layout(v_1GKE)
    return _compiled_flex_region(q_1HQE, k_1GKE, v_1GKE, block_mask)


def flex_layout(x_1HNE: Tensor) -> Tensor:
    """`x_1HNE` in the layout block_attention hands flex (FLEX_LAYOUT), copied only if it is
    not: benchmarks build their inputs so to time the region without the conversion."""
    return tokens_major(x_1HNE) if FLEX_LAYOUT == "tokens" else heads_major(x_1HNE)


def heads_major(x_1HNE: Tensor) -> Tensor:
    """`x_1HNE` contiguous ([1, H, N, E] in memory): the default layout (`_layout_from_env`)."""
    return x_1HNE.contiguous()


def tokens_major(x_1HNE: Tensor) -> Tensor:
    """`x_1HNE` stored as [1, N, H, E] (viewed [1, H, N, E]), copied only if it is not: the
    layout the drafter's projections write ([N, H*E] rows, heads side by side), with
    DFLASH_FLEX_LAYOUT=tokens. flex reads it in place (it needs only the head dimension
    contiguous) and writes its output alike, so the layer's q/k/v need no transposing copies;
    but its kernels run slower on it than those copies cost (`_layout_from_env`), so it is not
    the default."""
    assert x_1HNE.size(0) == 1, x_1HNE.shape  # one packed sequence
    if not x_1HNE.transpose(1, 2).is_contiguous():
        x_1HNE = x_1HNE.transpose(1, 2).contiguous().transpose(1, 2)
    # one stride for the size-1 batch dimension too (Dynamo's guards compare it), by views
    # whose backward is views too (indexing [0] would zero-fill and copy every gradient)
    return x_1HNE.squeeze(0).unsqueeze(0)


def pack_heads(x_1HQE: Tensor, groups: int) -> Tensor:
    """Query heads folded into rows per key/value group: [1,H,Q,E] -> [1,G,Q*R,E] with R = H/G
    and row q*R + r holding query q of the group's head r (head g*R + r, as GQA maps heads), so
    the R rows of one query are adjacent and an anchor block of B queries is B*R rows. Written
    tokens-major ([Q*R, G, E] in memory, `tokens_major`): one copy, and block_attention's
    heads-major default makes it contiguous with a second (pack_heads is off and loses)."""
    _, heads, q_len, dim = x_1HQE.shape
    per_group = heads // groups
    rows_1QRGE = x_1HQE.reshape(1, groups, per_group, q_len, dim).permute(0, 3, 2, 1, 4)
    return rows_1QRGE.reshape(1, q_len * per_group, groups, dim).transpose(1, 2)


def unpack_heads(x_1GPE: Tensor, heads: int) -> Tensor:
    """pack_heads undone: [1,G,Q*R,E] -> [1,H,Q,E], written tokens-major ([Q, H, E] in memory,
    as the layers' o_proj reads it)."""
    _, groups, rows, dim = x_1GPE.shape
    per_group = heads // groups
    q_len = rows // per_group
    rows_1QGRE = x_1GPE.reshape(1, groups, q_len, per_group, dim).permute(0, 2, 1, 3, 4)
    return rows_1QGRE.reshape(1, q_len, heads, dim).transpose(1, 2)


def dense_sdpa_attention(
    q_1HQE: Tensor, k_1GKE: Tensor, v_1GKE: Tensor, mask_1QK: Tensor
) -> Tensor:
    """SDPA with a dense boolean mask ([1, 1, Q, KV], True = attend); scale 1/sqrt(E)."""
    return F.scaled_dot_product_attention(
        q_1HQE, k_1GKE, v_1GKE, attn_mask=mask_1QK, enable_gqa=q_1HQE.size(1) != k_1GKE.size(1)
    )


class BlockAttention:
    """The anchor-block attention of one packed sequence, mask prepared once.

    Args:
        anchors_A: anchor positions (int64), sorted, padding (-1) at the end.
        document_ids_S: document id of every context position (padding: its own id, e.g. -1).
        block_size: B.
        backend: "flex", "sdpa", or "auto" (flex on CUDA, sdpa elsewhere).
        tables: the mask's intervals and tile tables of these anchors, already on their
            device (the loader builds them on CPU: `Batch.mask_tables`, with
            ``rows_per_block = block_size * heads_per_group`` when packed); None builds them
            here, on the anchors' device.
        heads_per_group: R > 1 folds the R query heads of each key/value group into the
            flex kernel's rows (`pack_heads`, `run.pack_heads`): a 64-row tile is then one
            anchor block of 16 queries x 4 heads, whose context is one interval, not the
            union of four anchors' (fewer key tiles visited). The same output; flex only
            (the SDPA path ignores it).
    """

    def __init__(
        self,
        anchors_A: Tensor,
        document_ids_S: Tensor,
        block_size: int,
        backend: Backend = "auto",
        tables: MaskTables | None = None,
        heads_per_group: int = 1,
    ) -> None:
        if backend == "auto":
            backend = "flex" if anchors_A.device.type == "cuda" else "sdpa"
        if backend not in ("flex", "sdpa"):
            raise ValueError(f"attention backend must be auto, flex or sdpa, got {backend!r}")
        self.backend = backend
        self.context_len = document_ids_S.numel()
        self.block_size = block_size
        self.num_queries = anchors_A.numel() * block_size
        self.heads_per_group = heads_per_group if backend == "flex" else 1
        rows_per_block = block_size * self.heads_per_group
        kv_len = self.context_len + self.num_queries
        if tables is None:
            ctx_lo_A, ctx_hi_A = context_intervals(anchors_A, document_ids_S)
        else:  # the same anchors' tables: their tile grid fits these shapes
            query_rows = anchors_A.numel() * rows_per_block
            grid = (-(-query_rows // TILE), -(-kv_len // TILE))
            rows, width = tables.kv_indices.shape[-2:]  # narrow tables: width <= key tiles
            assert rows == grid[0] and width <= grid[1], (tables.kv_indices.shape, grid)
            ctx_lo_A, ctx_hi_A = tables.ctx_lo_A, tables.ctx_hi_A
        self.ctx_lo_A, self.ctx_hi_A = ctx_lo_A, ctx_hi_A
        self.mask_mod = anchor_block_mask_mod(ctx_lo_A, ctx_hi_A, self.context_len, block_size)
        self.block_mask: BlockMask | None = None
        self.mask_1QK: Tensor | None = None
        if backend == "flex":
            args = (ctx_lo_A, ctx_hi_A, self.context_len, block_size)
            self.block_mask = (
                anchor_block_mask(*args, rows_per_block=rows_per_block)
                if tables is None
                else block_mask_from_tables(
                    tables, self.context_len, block_size, rows_per_block=rows_per_block
                )
            )
        else:
            self.mask_1QK = create_mask(
                self.mask_mod, 1, 1, self.num_queries, kv_len, device=anchors_A.device
            )

    def __call__(self, q_1HQE: Tensor, k_1GKE: Tensor, v_1GKE: Tensor) -> Tensor:
        """Attention output [1, H, Q, E]."""
        assert q_1HQE.size(2) == self.num_queries, (q_1HQE.shape, self.num_queries)
        assert k_1GKE.size(2) == self.context_len + self.num_queries, k_1GKE.shape
        if self.block_mask is not None:
            if self.heads_per_group == 1:
                return block_attention(q_1HQE, k_1GKE, v_1GKE, self.block_mask)
            groups = k_1GKE.size(1)
            assert q_1HQE.size(1) == groups * self.heads_per_group, (q_1HQE.shape, k_1GKE.shape)
            q_1GPE = pack_heads(q_1HQE, groups)
            o_1GPE = block_attention(q_1GPE, k_1GKE, v_1GKE, self.block_mask)
            return unpack_heads(o_1GPE, q_1HQE.size(1))
        assert self.mask_1QK is not None
        return dense_sdpa_attention(q_1HQE, k_1GKE, v_1GKE, self.mask_1QK)
