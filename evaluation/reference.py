"""The uncached reference of online acceptance: the yardstick the cached path must equal.

Both sides recompute their forwards over the whole sequence at every step (no KV cache, no
feature buffer, the drafter re-fuses its whole context): slow, and simple enough to trust.
`dflash evaluate` runs the cached path (evaluation.acceptance, evaluation.dflash_draft); the
tests compare its accepted tokens with these, and bench/bench_evaluate.py times both.

Legend: T tokens, K tapped layers, D hidden, V vocab, B block size, S = T + 1 context rows.
"""

from __future__ import annotations

import torch

from evaluation.acceptance import DraftFn, TokenPicker


class TappedTarget:
    """Target forward over a whole sequence, with the tapped layers' hidden states; `picker`
    gives the target's tokens after the last rows (default: greedy)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tapped_layers: list[int] | None,
        picker: TokenPicker | None = None,
    ) -> None:
        self.model = model
        self.tapped_layers = tapped_layers
        self.picker = picker or TokenPicker()
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def __call__(self, tokens: list[int], num_picked: int) -> tuple[list[int], torch.Tensor | None]:
        """The target's tokens after each of the last `num_picked` positions (only those draw
        from a sampling picker, as the cached path draws), and the features of all."""
        ids_1T = torch.tensor([tokens], device=self.device)
        out = self.model(ids_1T, output_hidden_states=self.tapped_layers is not None)
        # the last row picks the token at index len(tokens)
        picked = self.picker(out.logits[0, -num_picked:], len(tokens) - num_picked + 1, tokens)
        if self.tapped_layers is None:
            return picked, None
        # layer i = output of decoder layer i = hidden_states[i + 1]
        feats_TKD = torch.stack([out.hidden_states[i + 1][0] for i in self.tapped_layers], 1)
        return picked, feats_TKD


def reference_generate(
    target: TappedTarget, prompt: list[int], draft_fn: DraftFn, num_new: int
) -> tuple[list[int], list[int], list[int]]:
    """Speculative decoding, all recomputed; returns (generated tokens, tokens gained per
    forward, drafted tokens accepted per forward among those gained)."""
    (first,), feats_TKD = target(prompt, 1)
    tokens = [*prompt, first]
    # Features exist for every token but the last (the target has not run on it yet).
    feats = feats_TKD
    gains: list[int] = []
    accepted_counts: list[int] = []
    while len(tokens) - len(prompt) < num_new:
        draft = draft_fn(tokens, feats)
        # picked[j]: the target's token after tokens + draft[:j]
        picked, all_feats = target(tokens + draft, len(draft) + 1)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == picked[accepted]:
            accepted += 1
        bonus = picked[accepted]
        room = num_new - (len(tokens) - len(prompt))
        gained = [*draft[:accepted], bonus][:room]
        tokens += gained
        gains.append(len(gained))
        accepted_counts.append(min(accepted, len(gained)))
        feats = None if all_feats is None else all_feats[: len(tokens) - 1]
    return tokens[len(prompt) :], gains, accepted_counts


def reference_dflash_draft_fn(
    drafter: torch.nn.Module, embed_VD: torch.Tensor, head_VD: torch.Tensor
) -> DraftFn:
    """Draft B-1 tokens with a DFlash drafter through its training forward and mask.

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
