"""What extraction keeps of one LM-head chunk: per logit row the argmax, top-k and log-sum-exp.

`TappedTarget._head` applies the LM head in chunks of C rows and hands each chunk's logits
(the head's dtype: bf16 for a bf16 target) to `head_chunk_stats`.

Eager (the CPU's default; verifier.compile_head=false) the results are bit for bit those of
`argmax`, `topk` and `logsumexp(logits.float())`, with fewer passes over the [C, V] logits:
- the log-sum-exp shifts by topk's first value, which is amax's, masked as torch.logsumexp
  masks an infinite max, and subtracts it from the bf16 logits in fp32 by type promotion: one
  fp32 [C, V] temporary (the shifted row) instead of torch's copy plus shifted row, no max pass;
- on the CPU the argmax comes from the top-k (`argmax_from_topk`), not from another pass over
  the row (on a GPU it stays torch.argmax: see `chunk_stats`).

Compiled (`compiled_chunk_stats`, `verifier.compile_head=true`, a CUDA target's default)
inductor fuses the fp32 shift, exp and sum and the argmax into one reduction that reads the bf16
row once and never writes an fp32 copy; topk stays ATen's kernel (inductor calls it), so ids and
values are eager's; the argmax is inductor's reduction (the first maximal index, as
torch.argmax); the log-sum-exp sums in inductor's order, within fp32 rounding of eager's
(tests/test_head_stats.py).

Legend: C rows of one chunk, V vocabulary, k top-k.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

Stats = tuple[Tensor, Tensor, Tensor, Tensor]  # argmax_C, topk ids_Ck, topk values_Ck, lse_C


def argmax_from_topk(raw_CV: Tensor, vals_Ck: Tensor, ids_Ck: Tensor) -> Tensor:
    """torch.argmax of each row (its first maximal index) from the row's sorted top-k.

    topk orders tied values arbitrarily, so its first id may be a later maximal one. But when
    the k-th value is below the maximum, every maximal id is among the k, and the smallest of
    them is argmax's answer. Rows whose k values all equal the maximum (more maximal ids than
    k may exist, and topk kept any of them) take argmax itself; bf16 logits of a real target
    almost never tie k ways, so that pass runs on a handful of rows at most. NaN counts as the
    maximum and as equal to NaN, as in argmax and topk.
    """
    top_C1 = vals_Ck[:, :1]
    tied_Ck = (vals_Ck == top_C1) | (vals_Ck.isnan() & top_C1.isnan())
    argmax_C = torch.where(tied_Ck, ids_Ck, torch.iinfo(ids_Ck.dtype).max).amin(-1)
    unsure_C = tied_Ck[:, -1]  # values are sorted: the last tied means all k tie
    if unsure_C.any():
        rows = unsure_C.nonzero().squeeze(1)
        argmax_C[rows] = raw_CV[rows].argmax(-1)
    return argmax_C


def chunk_stats(raw_CV: Tensor, k: int) -> Stats:
    """(argmax_C, top-k ids_Ck, top-k values_Ck in fp32, log-sum-exp_C in fp32) of the logit
    rows `raw_CV`; pure. The same function runs eager and under torch.compile."""
    vals_Ck, ids_Ck = raw_CV.topk(k, dim=-1)
    max_C1 = vals_Ck[:, :1].float()
    # torch.logsumexp's own shift: an infinite max shifts by 0 (a row of -inf gives -inf)
    shift_C1 = torch.where(max_C1.abs() == math.inf, 0.0, max_C1)
    # bf16 minus fp32 computes in fp32 (the cast is exact): the same numbers as the fp32 copy
    lse_C = (raw_CV - shift_C1).exp_().sum(-1).log_().add_(shift_C1[:, 0])
    if raw_CV.device.type == "cpu" and not torch.compiler.is_compiling():
        argmax_C = argmax_from_topk(raw_CV, vals_Ck, ids_Ck)
    else:
        # compiled: a reduction over the same row as the sum above, inductor fuses both into
        # one read; eager on a GPU: argmax_from_topk's branch on the data would make the host
        # wait for the device every chunk, and the host must run ahead (TappedTarget.forward)
        argmax_C = raw_CV.argmax(-1)
    return argmax_C, ids_Ck, vals_Ck.float(), lse_C


def _tail_chunk_stats(raw_CV: Tensor, k: int) -> Stats:
    """`chunk_stats` under a code object of its own: Dynamo keeps compiled graphs per code
    object and tries the most recently used first, so the short chunks' row-dynamic graph
    never serves the full chunks, which keep their static one."""
    return chunk_stats(raw_CV, k)


@functools.cache
def compiled_chunk_stats() -> tuple[Callable[[Tensor, int], Stats], Callable[[Tensor, int], Stats]]:
    """`chunk_stats` compiled for (full chunks, the last short chunk of a batch).

    Full chunks have one shape for the whole run: a static graph. The last chunk of each batch
    has N % C rows, a new count nearly every batch: its rows are marked dynamic, so one graph
    serves them all (plus one for a single row, which Dynamo always specialises) instead of a
    recompile per batch until Dynamo's recompile limit. fullgraph: a graph break raises instead
    of running eager silently.
    """
    full = torch.compile(chunk_stats, dynamic=False, fullgraph=True)
    tail = torch.compile(_tail_chunk_stats, dynamic=False, fullgraph=True)
    return full, tail


def head_chunk_stats(raw_CV: Tensor, k: int, chunk_rows: int, compiled: bool) -> Stats:
    """`chunk_stats` of one LM-head chunk, eager or through the compiled graphs; `chunk_rows`
    is the configured chunk size, which tells the full chunks from the last short one."""
    if not compiled:
        return chunk_stats(raw_CV, k)
    full, tail = compiled_chunk_stats()
    if raw_CV.shape[0] == chunk_rows:
        return full(raw_CV, k)
    torch._dynamo.maybe_mark_dynamic(raw_CV, 0)
    return tail(raw_CV, k)
