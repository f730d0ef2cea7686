"""One shard of an HDF5 import laid out in extract's shard buffers (stage1_extract/host_buffers),
as `fill_shard` lays out the target's outputs: the pieces of the packing plan read from the
file's flat token stream, padding as extract writes it, and the verifier arrays from the file,
the target's LM head or the data (from_hdf5.py says which and why).

Legend: L tokens of a piece, K tapped layers, D hidden size, V vocabulary, k top-k, M = n * S
token slots of a shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.store import encode_hidden
from dflash_offline.convert.hdf5_input import Hdf5Input
from stage1_extract.host_buffers import ShardBuffers
from stage1_extract.packing import PackingPlan, shard_pieces
from stage1_extract.writer import ShardTask

HEAD_CHUNK = 1024  # tokens per LM-head matmul (bounds the fp32 logits buffer)


class ShardFiller:
    """Fills shard after shard of one import into a reused set of buffers."""

    def __init__(
        self,
        inp: Hdf5Input,
        plan: PackingPlan,
        per_shard: int,
        tokenizer: dict[str, Any],
        verifier: str,
        topk: int,
        last_layer: int,
        head_VD: torch.Tensor,
        overlong: str,
        hidden_dtype: str,
    ) -> None:
        self.inp, self.plan, self.per_shard = inp, plan, per_shard
        self.pad_id, self.vocab = int(tokenizer["pad_token_id"]), int(tokenizer["vocab_size"])
        self.verifier, self.topk, self.last_layer = verifier, topk, last_layer
        self.head_VD, self.overlong, self.hidden_dtype = head_VD, overlong, hidden_dtype
        f = inp.file
        # per-document arrays are small: read once (h5py reads scattered rows slowly)
        self.source = (
            np.asarray(f["doc_source_index"][...], np.int64)
            if "doc_source_index" in f
            else np.arange(len(inp.lengths), dtype=np.int64)
        )

    def _piece(self, lo: int, L: int, doc: int) -> dict[str, torch.Tensor]:
        """Tokens [lo, lo + L) of the file: every per-token array of the store, as tensors."""
        f, span = self.inp.file, np.s_[lo : lo + L]
        tokens = np.asarray(f["tokens"][span]).astype(np.int32)
        if (bad := (tokens < 0) | (tokens >= self.vocab)).any():
            raise ValueError(
                f"{self.inp.path}: /tokens of document {doc} hold id {tokens[bad][0]}, outside "
                f"the tokenizer's {self.vocab} ids; give the tokenizer the ids came from"
            )
        loss = np.asarray(f["loss_mask"][span]).astype(np.uint8) if "loss_mask" in f else 1
        hidden_LKD = self.inp.floats("hidden", span)
        if not torch.isfinite(hidden_LKD).all():
            raise ValueError(f"{self.inp.path}: /hidden of document {doc} holds NaN/Inf values")
        out = {
            "tokens": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy(np.broadcast_to(loss, (L,)).copy()),
            "hidden": hidden_LKD,
        }
        return out | self._verifier(span, tokens, hidden_LKD)

    def _verifier(
        self, span: Any, tokens: np.ndarray, hidden_LKD: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        f = self.inp.file
        if self.verifier == "input":
            names = ("target_argmax", "topk_ids", "topk_logits", "logsumexp")
            dtypes = (np.int32, np.int32, np.float32, np.float32)
            return {
                n: torch.from_numpy(np.asarray(f[n][span]).astype(d))
                for n, d in zip(names, dtypes, strict=True)
            }
        if self.verifier == "data":  # the next token of the document; the last: the pad id
            argmax = torch.from_numpy(np.append(tokens[1:], self.pad_id).astype(np.int32))
            zeros = torch.zeros(len(tokens), dtype=torch.float32)
            return {
                "target_argmax": argmax,
                "topk_ids": argmax[:, None],
                "topk_logits": zeros[:, None],
                "logsumexp": zeros,
            }
        final_LD = hidden_LKD[:, self.last_layer]  # the final norm's output: what the head reads
        parts = []
        for c in range(0, len(final_LD), HEAD_CHUNK):
            logits_CV = final_LD[c : c + HEAD_CHUNK] @ self.head_VD.T
            vals, ids = logits_CV.topk(self.topk, dim=-1)
            parts.append((logits_CV.argmax(-1), ids, vals, torch.logsumexp(logits_CV, -1)))
        argmax, ids, vals, lse = (torch.cat(p) for p in zip(*parts, strict=True))
        return {
            "target_argmax": argmax.int(),
            "topk_ids": ids.int(),
            "topk_logits": vals,
            "logsumexp": lse,
        }

    def shard(self, index: int, buffers: ShardBuffers) -> ShardTask:
        """Lay shard `index` out in `buffers`; the task write_shard commits."""
        plan, S, inp = self.plan, self.plan.seq_len, self.inp
        pieces = shard_pieces(plan, index, self.per_shard)
        n = min(self.per_shard, plan.num_sequences - index * self.per_shard)
        m, host = n * S, buffers.tensors
        for tensor in host.values():  # buffers are reused: padding must read as extract's
            tensor[:m] = 0
        host["tokens"][:m], host["document_ids"][:m] = self.pad_id, -1
        if "hidden_scale" in host:
            host["hidden_scale"][:m] = 1.0
        rows = plan.doc_row[pieces]
        sequences = plan.sequence[pieces] - index * self.per_shard
        for j, p in enumerate(pieces.tolist()):
            L, slot = int(plan.length[p]), int(sequences[j] * S + plan.start[p])
            lo = int(inp.starts[rows[j]] + plan.src_offset[p])
            arrays = self._piece(lo, L, int(rows[j]))
            hidden_LKD = arrays.pop("hidden")
            stored, scale = encode_hidden(hidden_LKD, self.hidden_dtype)
            host["hidden"][slot : slot + L] = stored
            if scale is not None:
                host["hidden_scale"][slot : slot + L] = scale
            for name, values in arrays.items():
                host[name][slot : slot + L] = values
            host["position_ids"][slot : slot + L] = torch.arange(L, dtype=torch.int32)
            host["document_ids"][slot : slot + L] = j
        lengths, doc_length = plan.length[pieces], inp.lengths[rows]
        over, split = doc_length > S, self.overlong == "split"
        attrs = {
            "index": index,
            "num_sequences": n,
            "num_documents": len(pieces),
            "num_tokens": int(lengths.sum()),
            "num_loss_tokens": int(host["loss_mask"][:m].sum()),
            "split_documents": int((over & (plan.piece[pieces] == 0)).sum()) if split else 0,
            "truncated_documents": 0 if split else int(over.sum()),
            "dropped_tokens": 0 if split else int((doc_length - lengths)[over].sum()),
        }
        documents = {
            "doc_source_index": self.source[rows],
            "doc_piece": plan.piece[pieces].astype(np.int32),
            "doc_sequence": sequences.astype(np.int32),
            "doc_start": plan.start[pieces].astype(np.int32),
            "doc_length": lengths.astype(np.int32),
        }
        return ShardTask(index, n, documents, attrs)
