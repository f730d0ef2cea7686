"""`dflash evaluate --repetition-penalty`: the target's token at each position after
transformers' and vLLM's repetition penalty over the tokens before it (prompt and reply), in
greedy verification as in sampled. Checked against transformers' own processor row by row, and
end to end against `generate`'s greedy text with the penalty: speculative decoding must write
what the server writes, whatever was drafted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from evaluation.acceptance import (
    CachedTarget,
    Sampling,
    TokenPicker,
    penalize_repeats,
    prompt_lookup_draft,
    speculative_generate,
)

PROMPTS = [[5, 17, 42, 8, 5, 17, 42], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


@pytest.mark.parametrize("first_index", [3, 7])
def test_rows_penalized_as_transformers_penalizes(first_index: int) -> None:
    torch.manual_seed(6)
    context = [4, 9, 4, 2, 11, 9, 0, 7, 7, 3]
    logits_JV = torch.randn(4, 12) * 3
    penalized_JV = penalize_repeats(logits_JV, context, first_index, 1.4)
    for j in range(4):
        before_1T = torch.tensor([context[: first_index + j]])
        expected_1V = RepetitionPenaltyLogitsProcessor(1.4)(before_1T, logits_JV[j : j + 1].clone())
        torch.testing.assert_close(penalized_JV[j], expected_1V[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs the tokens before each row: 2 given"):
        penalize_repeats(logits_JV, context[:2], first_index, 1.4)


def test_greedy_with_a_penalty_writes_what_generate_writes(target: torch.nn.Module) -> None:
    """Whatever is drafted (nothing, prompt lookup, the target's own unpenalized argmax, which
    the penalty rejects now and then), the text is transformers' greedy text with the same
    penalty, and not the text without it."""

    @torch.inference_mode()
    def plain_argmax(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        grown = list(tokens)
        for _ in range(4):
            grown.append(int(target(torch.tensor([grown])).logits[0, -1].argmax()))
        return grown[len(tokens) :]

    picker = TokenPicker(Sampling(repetition_penalty=1.3))
    changed = 0
    for prompt in PROMPTS:
        with torch.inference_mode():
            ids_1T = torch.tensor([prompt])
            # no end of sequence: decoding runs all 20 tokens, as speculative_generate here
            common = {"max_new_tokens": 20, "do_sample": False, "eos_token_id": None}
            served = target.generate(ids_1T, repetition_penalty=1.3, **common)[0, len(prompt) :]
            unpenalized = target.generate(ids_1T, **common)[0, len(prompt) :]
        changed += served.tolist() != unpenalized.tolist()
        for draft in (
            lambda _t, _f: [],
            lambda toks, _f: prompt_lookup_draft(toks, 4),
            plain_argmax,
        ):
            generated, _gains, _counts = speculative_generate(
                CachedTarget(target, None, picker), prompt, draft, 20
            )
            assert generated == served.tolist()
    assert changed  # the penalty moved the text of at least one prompt
