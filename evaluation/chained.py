"""Chained offline acceptance: blocks anchored exactly where online decoding anchors them.

Online (`dflash evaluate`), the first block of a response is anchored at its first token (the
token the target's prefill wrote), and each next anchor is the last token gained:
p' = p + accepted + 1. The random anchors of the held-out estimate instead weigh every
response position alike, so the two figures need not agree. On a store of the target's own
greedy text (what `dflash generate` writes; greedy speculative decoding reproduces that text
token for token) the chain can be followed from the stored features alone: every step is one
drafter forward over all active chains of the batch, and a slot is accepted while it equals
the stored argmax. A response's tau is the mean over its steps of min(accepted + 1, tokens
left), averaged over responses as `dflash evaluate` averages prompts.

Online decoding (`--stop-at-eos`) writes the stop token that ends a reply, keeps it and counts
it; a store may hold it or not. A text or completion reply that the target ended holds it where
`dflash generate` wrote its text after the reply (its manifest's `reply_stop_token`): extract
stores it with loss, as the reply's last token, and a run ending in a stop token is not
extended (`stops_after` is false at a stop token). Such rows of other data, of generate
versions before, or whose stop generate did not write (one that would not tokenize back to its
id, or that a server did not name) end without it: the stored argmax of the reply's last token
is then that stop token, so the chain goes one token past what the store holds, labelled with
it. The stop ids are those online decoding stops at, as `dflash generate` recorded them (its
generation config's end of sequence too, e.g. Qwen3's `<|endoftext|>`); a store of other data
(or of generate versions before) gives only its tokenizer's and target config's. A chat store
holds its template's end-of-turn token, with loss where the target ended the turn with it;
after a reply cut at the token limit (or ended by another stop) it has no loss, the run ends at
the reply's last token, and nothing extends it (stop ids are looked for in text and completion
stores only): online, a cut reply goes on, and one ended by another stop counts that stop (one
token this figure leaves out).

Legend: T context tokens of the batch, A chains (one block each per step), B block size,
Q = A*B query tokens, K tapped layers, D hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from common.generated import eos_ids
from common.store import StoreInfo
from evaluation.heldout import block_acceptance
from stage2_train.anchors import block_labels, next_token_source
from stage2_train.data import Batch, StoreSequences
from stage2_train.step import FrozenHead, forward_batch, greedy_predictions

# dataset formats whose documents may hold a reply without the stop token that ended it (chat
# rows end in the template's end of turn)
STOPLESS_FORMATS = ("completion", "text")


def unstored_stop_ids(attrs: dict[str, Any]) -> frozenset[int]:
    """The ids online decoding stops at, for a store whose replies may not hold the one that
    ended them (STOPLESS_FORMATS; empty otherwise): those `dflash generate` recorded
    (`generation.stop_ids`: the tokenizer's and the generation config's end of sequence and the
    chat template's end of turn, the ids `dflash evaluate` stops at), else the end-of-sequence
    ids the store records (its tokenizer's and its target config's: the generation config's
    others, e.g. Qwen3's `<|endoftext|>`, are unknown to such a store)."""
    if attrs.get("dataset", {}).get("format") not in STOPLESS_FORMATS:
        return frozenset()
    recorded = attrs.get("generation", {}).get("stop_ids")
    if recorded is not None:
        return frozenset(recorded)
    config = attrs.get("target", {}).get("config", {})
    return frozenset(eos_ids(attrs["tokenizer"].get("eos_token_id"), config.get("eos_token_id")))


def stops_after(
    tokens_T: torch.Tensor, target_argmax_T: torch.Tensor, stop_ids: frozenset[int]
) -> torch.Tensor:
    """[T] bool: the target's next token after t is a stop token that t is not (online decoding
    ends at the first stop token)."""
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=tokens_T.device)
    return torch.isin(target_argmax_T.long(), stops) & ~torch.isin(tokens_T.long(), stops)


def response_runs(
    loss_mask_T: torch.Tensor, document_ids_T: torch.Tensor, stops_T: torch.Tensor | None = None
) -> torch.Tensor:
    """[R, 2] (start, end) of every maximal run of loss positions inside one document, of two
    tokens or more (a block needs a token after its anchor). With `stops_T` (`stops_after`), a
    run whose last token is followed by a stop token ends one past it: that token, not in the
    store, is the reply's last."""
    on_T = (loss_mask_T != 0) & (document_ids_T >= 0)
    starts, ends = [], []
    prev_on, prev_doc, start = False, -2, 0
    for t, (on, doc) in enumerate(zip(on_T.tolist(), document_ids_T.tolist(), strict=True)):
        if prev_on and (not on or doc != prev_doc):
            starts.append(start)
            ends.append(t)
        if on and (not prev_on or doc != prev_doc):
            start = t
        prev_on, prev_doc = on, doc
    if prev_on:
        starts.append(start)
        ends.append(len(on_T))
    runs = torch.tensor([starts, ends], dtype=torch.long).T.reshape(-1, 2)
    if stops_T is not None and len(runs):
        runs[:, 1] += stops_T.cpu()[runs[:, 1] - 1].long()
    return runs[runs[:, 1] - runs[:, 0] >= 2]


def concat_sequences(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sequences end to end as one context, document ids made unique across them."""
    docs, next_doc = [], 0
    for item in items:
        docs_S = item["document_ids"].long()
        docs.append(torch.where(docs_S >= 0, docs_S + next_doc, -1))
        next_doc += int(docs_S.max()) + 1 if (docs_S >= 0).any() else 0
    out = {
        name: torch.cat([item[name] for item in items])
        for name in items[0]
        if name != "document_ids"
    }
    out["document_ids"] = torch.cat(docs)
    return out


def anchor_slots(num_runs: int) -> int:
    """The anchor count a batch of `num_runs` responses is padded to: a power of two, >= 16."""
    return max(16, 1 << max(num_runs - 1, 0).bit_length())


def blank_sequence(item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sequence row of `item`'s shapes holding nothing (no document, no loss): it fills a
    short last batch to the others' context length, so the attention sees one shape."""
    blank = {name: torch.zeros_like(value) for name, value in item.items()}
    blank["document_ids"] = torch.full_like(item["document_ids"], -1)
    return blank


@torch.no_grad()
def chained_acceptance(
    model: torch.nn.Module,
    head: FrozenHead,
    items: list[dict[str, torch.Tensor]],
    *,
    block_size: int,
    mask_token_id: int,
    backend: str,
    chunk_tokens: int,
    device: torch.device,
    fixed_shapes: bool | None = None,
    stop_ids: frozenset[int] = frozenset(),
    on_step: Callable[[int, int, int], None] | None = None,
) -> list[tuple[int, int]]:
    """(tokens gained, steps) of every response of `items` (raw sequence rows: tokens,
    position_ids, document_ids, loss_mask, target_argmax, hidden as bf16 or fp8 bits, and
    hidden_scale for fp8), following the online chain of anchors; with `stop_ids`
    (`unstored_stop_ids`), a reply's stop token that the store does not hold is counted.
    `on_step(tokens gained, tokens to gain, steps)`, the batch's totals, after each step."""
    seq = {k: v.to(device) for k, v in concat_sequences(items).items()}
    tokens_T, docs_T = seq["tokens"].long(), seq["document_ids"]
    argmax_T = seq["target_argmax"].long()
    source_T = next_token_source(argmax_T)
    stops_T = stops_after(tokens_T, argmax_T, stop_ids) if stop_ids else None
    runs = response_runs(seq["loss_mask"].cpu(), docs_T.cpu(), stops_T).to(device)
    num_runs = runs.shape[0]
    if num_runs == 0:
        return []
    p_R, last_R = runs[:, 0].clone(), runs[:, 1] - 1  # the last token of a run gains nothing
    to_gain = int((last_R - p_R).sum()) if on_step else 0
    gained_R = torch.zeros(num_runs, dtype=torch.long, device=device)
    steps_R = torch.zeros_like(gained_R)
    # anchor slots: the runs rounded up to a power of two. The compiled attention keeps one
    # graph per shape and refuses past Dynamo's recompile limit (8), and a dev store's batches
    # hold different numbers of responses: this way a few shapes serve them all
    # (the compiled flex region's concern: the dense CPU path pads nothing, so costs nothing)
    fixed = backend == "flex" if fixed_shapes is None else fixed_shapes
    slots = anchor_slots(num_runs) if fixed else num_runs
    padding_A = torch.full((slots - num_runs,), -1, device=device)
    offsets_B = torch.arange(block_size, device=device)
    while bool((active_R := p_R < last_R).any()):
        # runs are disjoint and in order, so the active anchors are already sorted; padding
        # (-1) to a fixed count keeps the compiled attention's shapes the same every step
        anchors_A = torch.cat([torch.where(active_R, p_R, -1), padding_A])
        anchors_A = anchors_A[torch.argsort((anchors_A < 0).to(torch.int8), stable=True)]
        labels_AB, valid_AB = block_labels(
            anchors_A, tokens_T, seq["loss_mask"], docs_T, source_T, block_size
        )
        # the slot at a run's last token is labelled by the argmax before it: the same label
        # for a stored token, and the only one for a stop token past the store's (whose
        # position there is padding, another document or past the end)
        last_A = torch.full_like(anchors_A, -2)  # never a slot's position
        last_A[: int(active_R.sum())] = last_R[active_R]
        at_last_AB = anchors_A[:, None] + offsets_B == last_A[:, None]
        stop_A = argmax_T[(last_A - 1).clamp(min=0)]
        labels_AB = torch.where(at_last_AB, stop_A[:, None], labels_AB)
        valid_AB = valid_AB | at_last_AB
        batch = Batch(
            indices=torch.zeros(1, dtype=torch.long),
            tokens_T=tokens_T,
            position_ids_T=seq["position_ids"].long(),
            document_ids_T=docs_T,
            hidden_TKD=seq["hidden"],
            anchors_A=anchors_A,
            labels_AB=labels_AB,
            weights_AB=valid_AB.float(),
            hidden_scale_TK=seq.get("hidden_scale"),
        )
        hidden_QD = forward_batch(
            model, head, batch, block_size=block_size, mask_token_id=mask_token_id, backend=backend
        )
        pred_AB = greedy_predictions(hidden_QD, head.lm_head_VD, chunk_tokens).view_as(labels_AB)
        accepted_A = block_acceptance(pred_AB == labels_AB, valid_AB)
        accepted_R = torch.zeros_like(p_R)
        accepted_R[active_R] = accepted_A[: int(active_R.sum())]
        gain_R = torch.minimum(accepted_R + 1, last_R - p_R)
        gained_R += torch.where(active_R, gain_R, 0)
        steps_R += active_R.long()
        p_R = torch.where(active_R, p_R + accepted_R + 1, p_R)
        if on_step is not None:
            on_step(int(gained_R.sum()), to_gain, int(steps_R.sum()))
    return list(zip(gained_R.tolist(), steps_R.tolist(), strict=True))


def prompt_lookup_chains(
    items: list[dict[str, torch.Tensor]], num_draft: int, stop_ids: frozenset[int] = frozenset()
) -> list[tuple[int, int]]:
    """(tokens gained, steps) of prompt lookup on every response of `items`, followed as
    `dflash evaluate` follows it online: the draft at anchor p copies from its document's
    tokens up to p, and a drafted token is accepted while it equals the stored argmax of the
    position before it (on the target's own greedy text: the token the target writes there).
    No model runs: prompt lookup's figure on the same responses as `chained_acceptance`
    (`stop_ids` as there)."""
    # here, not at the top: evaluation.acceptance imports transformers, which training (this
    # module serves its dev evaluation) otherwise never loads
    from evaluation.acceptance import prompt_lookup_draft

    # the token arrays only: the hidden states (most of each row) play no part here
    text = ("tokens", "document_ids", "loss_mask", "target_argmax")
    seq = concat_sequences([{name: item[name] for name in text} for item in items])
    tokens, docs = seq["tokens"].long().tolist(), seq["document_ids"].tolist()
    argmax_T = seq["target_argmax"].long()
    stops_T = stops_after(seq["tokens"], argmax_T, stop_ids) if stop_ids else None
    argmax = argmax_T.tolist()
    chains = []
    for start, end in response_runs(seq["loss_mask"], seq["document_ids"], stops_T).tolist():
        doc_start = docs.index(docs[start])  # documents are contiguous within a sequence
        p, last, gained, steps = start, end - 1, 0, 0
        while p < last:
            draft = prompt_lookup_draft(tokens[doc_start : p + 1], num_draft)
            accepted = 0
            # slot k (position p + k) is accepted while inside the response (its stop token
            # included) and equal to the target's prediction of that position (its argmax at
            # p + k - 1)
            while accepted < len(draft) and p + accepted + 1 < end:
                if draft[accepted] != argmax[p + accepted]:
                    break
                accepted += 1
            gained += min(accepted + 1, last - p)
            steps += 1
            p += accepted + 1
        chains.append((gained, steps))
    return chains


def summarize_chains(chains: list[tuple[int, int]]) -> dict[str, Any]:
    """tau per response averaged over responses (as online averages prompts), and pooled."""
    if not chains:
        return {"chained_tau": None, "chained_responses": 0}
    per_response = [g / s for g, s in chains if s > 0]
    return {
        "chained_tau": round(sum(per_response) / len(per_response), 4),
        "chained_tau_pooled": round(sum(g for g, _ in chains) / sum(s for _, s in chains), 4),
        "chained_tau_per_response": [round(t, 4) for t in per_response],
        "chained_responses": len(per_response),
    }


def chained_tau_on_store(
    model: torch.nn.Module,
    head: FrozenHead,
    info: StoreInfo,
    *,
    max_sequences: int | None = None,
    batch_sequences: int = 8,
    block_size: int,
    mask_token_id: int,
    backend: str,
    chunk_tokens: int,
    device: torch.device,
    prompt_lookup: bool = False,
    fixed_shapes: bool | None = None,
    layers: list[int] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """`summarize_chains` over the responses of a store's first `max_sequences` sequences
    (all by default), `batch_sequences` at a time; with `prompt_lookup`, prompt lookup's
    figures on the same responses too (`prompt_lookup_chained_tau`, ...). `fixed_shapes`
    (default: with the flex backend) pads every batch to a few attention shapes. `layers`: the
    tapped layers the drafter reads, when it reads fewer than the store holds. `progress`: a
    bar on stderr (`dflash evaluate-offline`: a batch is one drafter forward per step of its
    longest response, minutes on a CPU), whose note follows each step."""
    count = int(info.attrs["counts"]["sequences"])
    count = count if max_sequences is None else min(count, max_sequences)
    rows = StoreSequences(
        info,
        num_anchors=1,
        per_document=False,
        block_size=block_size,
        label_target="argmax",
        distill=False,
        seed=0,
        layers=layers,
    )
    was_training = model.training
    model.eval()
    fixed = backend == "flex" if fixed_shapes is None else fixed_shapes
    stop_ids = unstored_stop_ids(info.attrs)
    chains: list[tuple[int, int]] = []
    lookup_chains: list[tuple[int, int]] = []
    bar = tqdm(
        total=count, desc="chained tau", unit="seq", dynamic_ncols=True, disable=not progress
    )
    shown = 0.0

    def show_step(gained: int, to_gain: int, steps: int) -> None:
        nonlocal shown
        if time.monotonic() - shown >= 0.5:  # a step can take a millisecond on a GPU
            shown = time.monotonic()
            bar.set_postfix_str(
                f"batch {gained:,}/{to_gain:,} tokens, pooled tau {gained / steps:.2f}"
            )

    for lo in range(0, count, batch_sequences):
        items = [rows.read_row(i) for i in range(lo, min(lo + batch_sequences, count))]
        if prompt_lookup:
            lookup_chains += prompt_lookup_chains(items, block_size - 1, stop_ids)
        if fixed and count > batch_sequences:  # the last batch as long as the others
            items += [blank_sequence(items[0])] * (batch_sequences - len(items))
        chains += chained_acceptance(
            model,
            head,
            items,
            block_size=block_size,
            mask_token_id=mask_token_id,
            backend=backend,
            chunk_tokens=chunk_tokens,
            device=device,
            fixed_shapes=fixed,
            stop_ids=stop_ids,
            on_step=show_step if progress else None,
        )
        bar.update(min(batch_sequences, count - lo))
    bar.close()
    model.train(was_training)
    lookup = summarize_chains(lookup_chains).items() if prompt_lookup else ()
    return {**summarize_chains(chains), **{f"prompt_lookup_{k}": v for k, v in lookup}}
