"""Online acceptance length under greedy verification: what a drafter really buys.

The target verifies each drafted block with one forward: the longest prefix equal to the
target's own greedy tokens is accepted, then the target's next token is added. tau is the
number of tokens gained per target forward (accepted + 1), averaged over the forwards of a
prompt, then over prompts (the prefill forward, which drafts nothing, is not counted). Drafters: `prompt-lookup` (copy the continuation of the longest
earlier n-gram match, n = 4..1, no training) and `dflash` (an exported drafter folder).

Run: `dflash evaluate --target MODEL --data dev.jsonl.gz [--drafter RUN/export]`.
Both sides recompute their forwards over the whole sequence each step (no KV cache): slower,
but the accepted tokens are then exactly those of a cached implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Draft function: (token_ids, target hidden states of tapped layers for tokens[:-1]) -> draft ids
DraftFn = Callable[[list[int], torch.Tensor | None], list[int]]


@dataclass
class AcceptanceResult:
    tau_per_prompt: list[float]
    forwards: int
    new_tokens: int

    @property
    def tau(self) -> float:
        return sum(self.tau_per_prompt) / max(len(self.tau_per_prompt), 1)


def prompt_lookup_draft(tokens: list[int], num_draft: int, max_ngram: int = 4) -> list[int]:
    """Continuation of the most recent earlier occurrence of the longest suffix n-gram."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        pattern = tokens[-n:]
        # Search right to left among starts whose match ends before the current suffix.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []


class TappedTarget:
    """Greedy target forward that also returns the tapped layers' hidden states."""

    def __init__(self, model: torch.nn.Module, tapped_layers: list[int] | None) -> None:
        self.model = model
        self.tapped_layers = tapped_layers
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def __call__(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids_1T = torch.tensor([tokens], device=self.device)
        out = self.model(ids_1T, output_hidden_states=self.tapped_layers is not None)
        greedy_T = out.logits[0].argmax(-1)
        if self.tapped_layers is None:
            return greedy_T, None
        # layer i = output of decoder layer i = hidden_states[i + 1]
        feats_TKD = torch.stack([out.hidden_states[i + 1][0] for i in self.tapped_layers], 1)
        return greedy_T, feats_TKD


def speculative_generate(
    target: TappedTarget, prompt: list[int], draft_fn: DraftFn, num_new: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; returns (generated tokens, tokens gained per forward)."""
    greedy_T, feats_TKD = target(prompt)
    tokens = [*prompt, int(greedy_T[-1])]
    # Features exist for every token but the last (the target has not run on it yet).
    feats = feats_TKD
    gains: list[int] = []
    while len(tokens) - len(prompt) < num_new:
        draft = draft_fn(tokens, feats)
        greedy_T, all_feats = target(tokens + draft)
        base = len(tokens) - 1  # greedy_T[base + j] is the target's token after tokens+draft[:j]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == int(greedy_T[base + accepted]):
            accepted += 1
        bonus = int(greedy_T[base + accepted])
        room = num_new - (len(tokens) - len(prompt))
        gained = [*draft[:accepted], bonus][:room]
        tokens += gained
        gains.append(len(gained))
        feats = None if all_feats is None else all_feats[: len(tokens) - 1]
    return tokens[len(prompt) :], gains


def measure_acceptance(
    target: TappedTarget, prompts: list[list[int]], draft_fn: DraftFn, num_new: int
) -> AcceptanceResult:
    taus, forwards, new = [], 0, 0
    for prompt in prompts:
        generated, gains = speculative_generate(target, prompt, draft_fn, num_new)
        taus.append(sum(gains) / len(gains))
        forwards += len(gains)
        new += len(generated)
    return AcceptanceResult(taus, forwards, new)


def dflash_draft_fn(
    drafter: torch.nn.Module, embed_VD: torch.Tensor, head_VD: torch.Tensor
) -> DraftFn:
    """Draft B-1 tokens with a DFlash drafter: one block anchored at the last token.

    The anchor p = len(tokens) - 1 is the target's latest token, which has no features yet;
    the drafter sees the features of positions < p exactly as in training (a context of p + 1
    positions whose last row is never visible, since context visibility is strictly < p).
    """
    from stage2_train.attention import BlockAttention
    from stage2_train.model import build_block_inputs

    shape = drafter.shape
    device = embed_VD.device
    offsets_B = torch.arange(shape.block_size, device=device)

    @torch.inference_mode()
    def draft(tokens: list[int], feats_TKD: torch.Tensor | None) -> list[int]:
        assert feats_TKD is not None and feats_TKD.size(0) == len(tokens) - 1
        p = len(tokens) - 1
        tokens_S = torch.tensor(tokens, device=device)
        pad_1KD = feats_TKD.new_zeros(1, *feats_TKD.shape[1:])
        features_SKD = torch.cat([feats_TKD, pad_1KD])
        anchors_A = torch.tensor([p], device=device)
        attention = BlockAttention(
            anchors_A,
            torch.zeros(p + 1, dtype=torch.long, device=device),
            shape.block_size,
            backend="sdpa",
        )
        ids_AB = build_block_inputs(anchors_A, tokens_S, shape.block_size, shape.mask_token_id)
        hidden_QD = drafter(
            features_SKD,
            embed_VD[ids_AB.flatten()],
            torch.arange(p + 1, device=device),
            p + offsets_B,
            attention,
        )
        logits_QV = hidden_QD.to(head_VD.dtype) @ head_VD.T
        return logits_QV[1:].argmax(-1).tolist()

    return draft
