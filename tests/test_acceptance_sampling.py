"""Online acceptance under sampling (`dflash evaluate --temperature`).

The target's token at each position is a draw from its distribution at the temperature (cut
to the top-p nucleus); a draft is accepted while it equals those draws. The draws must follow
that distribution (checked against transformers' own temperature and top-p warpers, and by
frequency), so a drafted token d is accepted with probability p(d); the cached path must draw
exactly what the recompute reference draws; temperature near 0 must be greedy decoding; and
the command must report the sampling it ran and refuse settings out of range.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from log_capture import dflash_messages
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_offline.cli import main
from evaluation.acceptance import (
    CachedTarget,
    DraftFn,
    Sampling,
    TokenPicker,
    measure_acceptance,
    nucleus,
    prompt_lookup_draft,
    speculative_generate,
    top_k_only,
)
from evaluation.dflash_draft import dflash_draft_fn
from evaluation.reference import TappedTarget, reference_dflash_draft_fn, reference_generate
from stage2_train.config import DrafterConfig
from stage2_train.model import DFlashDrafter, drafter_shape

PROMPTS = [[5, 17, 42, 8, 5, 17, 42], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def tiny_drafter(target: torch.nn.Module) -> DFlashDrafter:
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=5), config, 2, config["vocab_size"], 3
    )
    torch.manual_seed(0)
    return DFlashDrafter(shape).eval()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999, 1.0])
def test_nucleus_keeps_what_transformers_top_p_keeps(top_p: float) -> None:
    """The tokens kept are those transformers' TopPLogitsWarper keeps (`dflash generate`'s
    local backend samples through it), with their probabilities unchanged."""
    torch.manual_seed(1)
    logits_JV = torch.randn(6, 50) * 3
    logits_JV[0, :4] = 2.0  # a tie at the top
    probs_JV = torch.softmax(logits_JV, -1)
    kept_JV = nucleus(probs_JV, top_p)
    warped_JV = TopPLogitsWarper(top_p)(None, logits_JV.clone())
    assert torch.equal(kept_JV > 0, torch.isfinite(warped_JV))
    torch.testing.assert_close(kept_JV[kept_JV > 0], probs_JV[kept_JV > 0], rtol=0, atol=0)
    assert (kept_JV > 0).sum(-1).min() >= 1


@pytest.mark.parametrize("top_k", [1, 3, 7, 50])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 1.0])
def test_top_k_then_nucleus_keeps_what_transformers_keeps(top_k: int, top_p: float) -> None:
    """Top-k, then the nucleus of what is left: the tokens transformers' TopKLogitsWarper then
    TopPLogitsWarper keep (their order in `generate`, and vLLM's), ties at the k-th kept, with
    the kept distribution transformers samples from."""
    torch.manual_seed(5)
    logits_JV = torch.randn(8, 40) * 2
    logits_JV[0, :6] = 9.0  # a tie at the top, across the k-th place
    logits_JV[1, 10:13] = 1.0
    probs_JV = torch.softmax(logits_JV, -1)
    kept_JV = nucleus(top_k_only(probs_JV, top_k), top_p)
    warped_JV = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits_JV.clone()))
    assert torch.equal(kept_JV > 0, torch.isfinite(warped_JV))
    torch.testing.assert_close(kept_JV / kept_JV.sum(-1, keepdim=True), warped_JV.softmax(-1))
    if top_p == 1:
        assert (top_k_only(probs_JV, top_k) > 0).sum(-1)[0] == min(max(6, top_k), 40)
    assert top_k_only(probs_JV, 40) is probs_JV  # k = the vocabulary: nothing cut


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.7, 1.0, 0), (1.5, 0.8, 0), (1.2, 0.9, 4)]
)
def test_draws_follow_the_target_distribution(temperature: float, top_p: float, top_k: int) -> None:
    """Frequencies of 40,000 draws (one row per draw) within 4.5 standard errors of
    transformers' warped distribution; so the chance that a drafted token d equals the draw,
    its acceptance, is p(d)."""
    torch.manual_seed(2)
    logits_V = torch.randn(12) * 2
    scaled_1V = TemperatureLogitsWarper(temperature)(None, logits_V[None])
    if top_k:
        scaled_1V = TopKLogitsWarper(top_k)(None, scaled_1V)
    warped_V = TopPLogitsWarper(top_p)(None, scaled_1V)
    expected_V = torch.softmax(warped_V[0], -1).double()
    picker = TokenPicker(Sampling(temperature, top_p, seed=3, top_k=top_k))
    draws = picker(logits_V.expand(40_000, -1), 0)
    counts_V = torch.bincount(torch.tensor(draws), minlength=12).double()
    frequency_V = counts_V / len(draws)
    error_V = (expected_V * (1 - expected_V) / len(draws)).sqrt()
    assert ((frequency_V - expected_V).abs() <= 4.5 * error_V + 1e-12).all(), (
        frequency_V,
        expected_V,
    )
    assert counts_V[expected_V == 0].sum() == 0  # nothing outside the nucleus, ever


def test_picker_is_greedy_at_zero_and_keyed_by_prompt_and_index() -> None:
    """A draw depends on the seed, the prompt and the token's index alone: not on the draws
    before it, nor on which rows of a forward it shares."""
    torch.manual_seed(4)
    logits_JV = torch.randn(5, 30)
    assert TokenPicker()(logits_JV, 9) == logits_JV.argmax(-1).tolist()
    picker = TokenPicker(Sampling(1.0, 1.0, seed=7))
    picker.start(2)
    first = picker(logits_JV, 10)
    picker.start(5)
    picker(logits_JV, 10)  # another prompt's draws in between change nothing
    picker.start(2)
    assert picker(logits_JV, 10) == first
    # the same indices drawn one row at a time, in another order
    assert [picker(logits_JV[j : j + 1], 10 + j)[0] for j in (3, 0, 4, 1, 2)] == [
        first[j] for j in (3, 0, 4, 1, 2)
    ]
    assert picker(logits_JV[1:], 11) == first[1:]
    others = [picker(logits_JV, 10 + 5 * k) for k in range(1, 4)]  # other indices
    picker.start(3)
    others.append(picker(logits_JV, 10))  # another prompt
    assert all(draws != first for draws in others)
    other_seed = TokenPicker(Sampling(1.0, 1.0, seed=8))
    other_seed.start(2)
    assert other_seed(logits_JV, 10) != first


def test_every_drafter_meets_the_same_sampled_text(target: torch.nn.Module) -> None:
    """The text under sampling is plain sampling's, token by token (each draw keyed by its
    index), whatever was drafted: no draft, prompt lookup, a DFlash drafter and the target's
    own argmax continuation all write it, though they accept different counts."""
    sampling = Sampling(temperature=0.05, top_p=0.95, seed=3)
    drafter = tiny_drafter(target)
    embed_VD = target.get_input_embeddings().weight
    head_VD = target.get_output_embeddings().weight
    for index, prompt in enumerate(PROMPTS):
        picker = TokenPicker(sampling)
        picker.start(index)
        plain = list(prompt)
        with torch.inference_mode():
            while len(plain) < len(prompt) + 20:
                logits_1V = target(torch.tensor([plain])).logits[0, -1:]
                plain += picker(logits_1V, len(plain))
        texts, accepted = [], []
        for tapped, draft in [
            (None, lambda toks, _f: []),
            (None, lambda toks, _f: prompt_lookup_draft(toks, 4)),
            ([0, 2], dflash_draft_fn(drafter, embed_VD, head_VD)),
            (None, greedy_continuation(target, 4)),
        ]:
            generated, _gains, counts = speculative_generate(
                CachedTarget(target, tapped, picker), prompt, draft, 20
            )
            texts.append(generated)
            accepted.append(sum(counts))
        assert all(text == plain[len(prompt) :] for text in texts)
        assert accepted[0] == 0 and accepted[-1] > 0


def greedy_continuation(model: torch.nn.Module, num_draft: int) -> DraftFn:
    """Drafts the target's own argmax continuation: at a low temperature most draws equal it,
    some do not, so both acceptance and rejection happen."""

    @torch.inference_mode()
    def draft(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        grown = list(tokens)
        for _ in range(num_draft):
            grown.append(int(model(torch.tensor([grown])).logits[0, -1].argmax()))
        return grown[len(tokens) :]

    return draft


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("method", ["argmax", "dflash"])
def test_cached_path_draws_what_the_reference_draws(
    target: torch.nn.Module, method: str, penalty: float
) -> None:
    """Under sampling the cached path (KV cache cropped, feature buffer, drafter context cache)
    and the recompute reference take the same draws, accept the same drafts and write the same
    text, with a repetition penalty too (each reads the tokens before a row its own way). The
    tiny target's distribution is near uniform, so temperature 0.02 makes it peaked enough
    that drafting its argmax is accepted often but not always."""
    drafter = tiny_drafter(target)
    embed_VD = target.get_input_embeddings().weight
    head_VD = target.get_output_embeddings().weight
    tapped = [0, 2] if method == "dflash" else None
    sampling = Sampling(temperature=0.02, top_p=0.9, seed=11, repetition_penalty=penalty)
    accepted, forwards, new = 0, 0, 0
    for index, prompt in enumerate(PROMPTS):
        cached_picker, reference_picker = TokenPicker(sampling), TokenPicker(sampling)
        cached_picker.start(index)
        reference_picker.start(index)
        if method == "dflash":
            cached_draft = dflash_draft_fn(drafter, embed_VD, head_VD)
            reference_draft = reference_dflash_draft_fn(drafter, embed_VD, head_VD)
        else:
            cached_draft = reference_draft = greedy_continuation(target, 4)
        cached = speculative_generate(
            CachedTarget(target, tapped, cached_picker), prompt, cached_draft, 24
        )
        reference = reference_generate(
            TappedTarget(target, tapped, reference_picker), prompt, reference_draft, 24
        )
        assert cached == reference
        accepted, forwards, new = accepted + sum(cached[2]), forwards + len(cached[1]), new + 23
    if method == "argmax":
        # some drafts accepted, some rejected (all accepted: 24 tokens in 5 forwards a prompt)
        assert 0 < accepted < new and forwards > 2 * 5


def test_near_zero_temperature_is_greedy(target: torch.nn.Module) -> None:
    """At a temperature near 0 the draws are the argmax: the same text, gains and accepted
    counts as greedy verification."""
    draft = lambda toks, _f: prompt_lookup_draft(toks, 4)  # noqa: E731
    for prompt in PROMPTS:
        greedy = speculative_generate(CachedTarget(target, None), prompt, draft, 20)
        cold = CachedTarget(target, None, TokenPicker(Sampling(1e-6, 1.0, seed=5)))
        assert speculative_generate(cold, prompt, draft, 20) == greedy


def test_sampled_text_differs_from_greedy_and_by_seed(target: torch.nn.Module) -> None:
    """At temperature 1 the text is the target's draws, not its argmax: another seed, another
    text; the same seed, the same text."""
    draft = lambda toks, _f: prompt_lookup_draft(toks, 4)  # noqa: E731

    def texts(seed: int) -> list[list[int]]:
        picker, out = TokenPicker(Sampling(1.0, 1.0, seed)), []
        for index, prompt in enumerate(PROMPTS):
            picker.start(index)
            out.append(
                speculative_generate(CachedTarget(target, None, picker), prompt, draft, 16)[0]
            )
        return out

    greedy = [speculative_generate(CachedTarget(target, None), p, draft, 16)[0] for p in PROMPTS]
    assert texts(0) == texts(0)
    assert texts(0) != texts(1)
    assert all(a != b for a, b in zip(texts(0), greedy, strict=True))


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "dev.jsonl"
    texts = ["def f(x):\n    return x\n" * 2, "import os\nimport sys\n" * 2]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def test_evaluate_command_reports_its_sampling(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = _data(tmp_path)
    out = tmp_path / "sampled.json"
    args = ["evaluate", "--target", str(tiny_qwen3), "--data", str(data), "--num-prompts", "2"]
    args += ["--new-tokens", "12", "--no-stop-at-eos", "--plot", str(tmp_path / "p.png")]
    sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "4", "--num-seeds", "2"]
    result = CliRunner().invoke(main, [*args, *sampled, "--top-k", "20", "--json-out", out])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["sampling"] == {
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 4,
        "num_seeds": 2,
        "top_k": 20,
        "repetition_penalty": 1.0,
    }
    assert len(figures["prompt_lookup"]["tau_per_prompt"]) == 2
    assert len(figures["prompt_lookup"]["tau_per_seed"]) == 2
    assert figures["prompt_lookup"]["new_tokens"] == 2 * 2 * 12  # 2 prompts x 2 seeds
    greedy = CliRunner().invoke(main, [*args, "--json-out", tmp_path / "greedy.json"])
    assert greedy.exit_code == 0, greedy.output
    assert json.loads((tmp_path / "greedy.json").read_text())["sampling"]["temperature"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-0.5"], "--temperature must be a number >= 0, got -0.5"),
        (["--temperature", "nan"], "--temperature must be a number >= 0, got nan"),
        (["--temperature", "1", "--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
        (["--temperature", "1", "--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
        (["--temperature", "1", "--seed", "-1"], r"--seed must be within \[0, 2\*\*63\), got -1"),
        (["--temperature", "1", "--num-seeds", "0"], "--num-seeds must be >= 1, got 0"),
        (["--temperature", "1", "--top-k", "-1"], r"--top-k must be >= 0 \(0: every token\)"),
    ],
)
def test_sampling_out_of_range_is_refused_by_flag(
    tiny_qwen3: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    args = ["evaluate", "--target", str(tiny_qwen3), "--data", str(_data(tmp_path)), *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert re.search(message, result.output), result.output


def test_top_p_without_temperature_is_warned(tiny_qwen3: Path, tmp_path: Path) -> None:
    from evaluation.online import EvaluateConfig, run_evaluate

    cfg = EvaluateConfig(str(tiny_qwen3), str(_data(tmp_path)), num_prompts=1, new_tokens=4)
    cfg.top_p, cfg.top_k, cfg.num_seeds, cfg.stop_at_eos = 0.9, 20, 3, False
    with dflash_messages(logging.WARNING) as seen:
        figures = run_evaluate(cfg)
    warning = "--top-p 0.9 / --top-k 20 / --seed 0 / --num-seeds 3 have no effect at"
    assert any(warning in m for m in seen), seen
    # greedy: each prompt decoded once, whatever --num-seeds says
    assert figures["prompt_lookup"]["new_tokens"] == 4
    assert len(figures["prompt_lookup"]["tau_per_seed"]) == 1


def test_num_seeds_is_the_mean_of_single_seed_runs(target: torch.nn.Module) -> None:
    """--seed 5 --num-seeds 3 decodes what --seed 5, 6 and 7 decode one by one: each prompt's
    tau is the mean of its three replies', tau_per_seed the three runs' taus, and the counts
    (forwards, tokens, histogram) their sums."""

    def measure(seed: int, num_seeds: int):
        picker = TokenPicker(Sampling(0.05, 0.95, seed, num_seeds))
        return measure_acceptance(
            CachedTarget(target, None, picker),
            PROMPTS,
            lambda: greedy_continuation(target, 3),
            12,
            3,
        )

    together = measure(5, 3)
    alone = [measure(seed, 1) for seed in (5, 6, 7)]
    assert together.tau_per_seed == pytest.approx([run.tau for run in alone])
    assert together.tau_per_prompt == pytest.approx(
        [sum(run.tau_per_prompt[i] for run in alone) / 3 for i in range(len(PROMPTS))]
    )
    assert together.forwards == sum(run.forwards for run in alone)
    assert together.new_tokens == sum(run.new_tokens for run in alone) == 3 * 2 * 12
    assert together.accepted_histogram == [
        sum(counts) for counts in zip(*(run.accepted_histogram for run in alone), strict=True)
    ]
    assert len(set(together.tau_per_seed)) > 1  # the seeds wrote different texts


def test_a_prompt_ended_at_once_under_some_seeds_keeps_its_other_replies(
    target: torch.nn.Module,
) -> None:
    """A reply that is the stop token alone is left out of its prompt's mean; the prompt is
    listed in ended_at_prefill only when every seed's reply was."""
    picker = TokenPicker(Sampling(1.0, 1.0, 0, 4))
    firsts = []
    for offset in range(4):
        picker.start(0, offset)
        firsts.append(CachedTarget(target, None, picker).prefill(PROMPTS[0], len(PROMPTS[0]) + 1))
    assert len(set(firsts)) > 1, firsts  # the seeds draw different first tokens
    draft = lambda: lambda toks, _f: prompt_lookup_draft(toks, 3)  # noqa: E731
    stop = frozenset({firsts[0]})
    result = measure_acceptance(
        CachedTarget(target, None, picker), PROMPTS[:1], draft, 6, 3, stop_ids=stop
    )
    assert result.ended_at_prefill == [] and len(result.tau_per_prompt) == 1
    assert result.stopped_at_eos >= firsts.count(firsts[0])
    everything = frozenset(firsts)
    result = measure_acceptance(
        CachedTarget(target, None, picker), PROMPTS[:1], draft, 6, 3, stop_ids=everything
    )
    assert result.ended_at_prefill == [0] and result.tau_per_prompt == []


# --- the nucleus over a real vocabulary, and losslessness end to end --------------------------


def test_nucleus_keeps_what_transformers_keeps_with_bf16_ties() -> None:
    """bf16 logits tie often, also at the nucleus' edge; the tokens kept there must be those
    TopPLogitsWarper keeps (generate's), not other tokens of the same probability (a descending
    sort kept others in ~2 rows of 3 here)."""
    torch.manual_seed(4)
    logits_JV = (torch.randn(24, 4096) * 4).bfloat16().float()
    for temperature in (0.6, 1.0):
        scaled_JV = TemperatureLogitsWarper(temperature)(None, logits_JV.clone())
        probs_JV = torch.softmax(logits_JV / temperature, -1)
        for top_p in (0.5, 0.9, 0.95, 0.999):
            kept_JV = nucleus(probs_JV, top_p) > 0
            warped_JV = TopPLogitsWarper(top_p)(None, scaled_JV.clone())
            # rows whose running tail mass passes within float32 rounding of 1 - top_p may
            # round either way (the two softmaxes sum in different orders): left out
            tail_JV = torch.softmax(logits_JV.double() / temperature, -1).sort(-1).values
            clear_J = ((tail_JV.cumsum(-1) - (1 - top_p)).abs() > 3e-7).all(-1)
            assert clear_J.sum() >= 12
            assert torch.equal(kept_JV[clear_J], torch.isfinite(warped_JV)[clear_J]), (
                temperature,
                top_p,
            )


@pytest.mark.parametrize("top_p", [0.9, 0.95, 0.999])
def test_nucleus_edge_over_a_150k_vocabulary(top_p: float) -> None:
    """A float32 softmax row over 151,936 tokens sums to 1 + ~2e-5: the nucleus must still hold
    the fewest most likely tokens whose mass reaches top_p, within one token of the count in
    float64 (counted from the top, that excess dropped ~300 edge tokens of these flat rows at
    top_p 0.999)."""
    torch.manual_seed(5)
    logits_JV = torch.randn(4, 151_936) * 4
    probs_JV = torch.softmax(logits_JV, -1)
    exact_JV = torch.softmax(logits_JV.double(), -1).sort(-1, descending=True).values
    # the exact nucleus: the fewest top tokens whose mass reaches top_p
    exact_J = (exact_JV.cumsum(-1) < top_p).sum(-1) + 1
    kept_J = (nucleus(probs_JV, top_p) > 0).sum(-1)
    assert ((kept_J - exact_J).abs() <= 1).all(), (kept_J.tolist(), exact_J.tolist())


def test_speculative_sampling_is_lossless_end_to_end() -> None:
    """The text written by speculative decoding under sampling follows the target's own
    sampled distribution, whatever the drafter proposes. A 6-token target (one layer, its LM
    head scaled so rows are peaked) samples at temperature 0.9, top-p 0.8; the exact
    distribution of its first three tokens (the prefill's, then two verified after a 2-token
    draft) is computed from its logits with transformers' warpers and compared with 1,600
    seeded runs of speculative_generate under a drafter proposing, by context, the likeliest
    token, a token outside the nucleus, or a fixed one: never a token outside the support, and
    a chi-square p-value far from rejection (the seeds are fixed: the same counts every run).
    Checked against broken rules: top-p applied after the acceptance test (79 runs outside the
    support), a rejection redrawn from p with d left in (p ~1e-98), the token after a rejection
    taken from the next row or no nucleus (~590 outside), temperature applied twice (p ~5e-8),
    drafts compared with the next row's draw (the acceptance bounds)."""
    from common.tiny import tiny_config

    vocab, temperature, top_p, runs = 6, 0.9, 0.8, 1600
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab, 1, 16)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12)
    prompt = [1, 4, 2, 5, 3]

    with torch.inference_mode():
        # every prompt + (x1, x2): its logits give p(x1), p(x2 | x1), p(x3 | x1, x2)
        pairs_N2 = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
        ids_NT = torch.cat([torch.tensor(prompt).expand(len(pairs_N2), -1), pairs_N2], 1)
        logits_NTV = model(ids_NT).logits.float()

    def sampled(logits_JV: torch.Tensor) -> torch.Tensor:
        """The distribution generate samples, by transformers' own warpers, in float64."""
        warped_JV = TopPLogitsWarper(top_p)(
            None, TemperatureLogitsWarper(temperature)(None, logits_JV)
        )
        return torch.softmax(warped_JV.double(), -1)

    n = len(prompt)
    first_V = sampled(logits_NTV[:1, n - 1])[0]
    second_VV = sampled(logits_NTV[::vocab, n])  # [x1, x2]
    third_VVV = sampled(logits_NTV[:, n + 1]).view(vocab, vocab, vocab)  # [x1, x2, x3]
    exact_VVV = first_V[:, None, None] * second_VV[:, :, None] * third_VVV
    # the fixture itself: a support wide enough to test, no row near its nucleus' edge (where
    # the cached forward's rounding could move a token across it)
    assert 30 <= int((exact_VVV > 0).sum()) < vocab**3
    for logits_JV in (logits_NTV[:1, n - 1], logits_NTV[::vocab, n], logits_NTV[:, n + 1]):
        tail_JV = torch.softmax(logits_JV.double() / temperature, -1).sort(-1).values.cumsum(-1)
        assert ((tail_JV - (1 - top_p)).abs() > 1e-4).all()

    def drafter(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        new = tokens[n:]
        if len(new) == 1:  # after the prefill: a 2-token draft for x2, x3
            (x1,) = new
            d1 = int(second_VV[x1].argmax() if x1 % 2 == 0 else second_VV[x1].argmin())
            d2 = int(third_VVV[x1, d1].argmax() if x1 % 3 else third_VVV[x1, d1].argmin())
            return [d1, d2]
        x1, x2 = new  # x2 was the correction of a rejected d1: a draft for x3
        return [int(third_VVV[x1, x2].argmax()) if (x1 + x2) % 2 else (x1 + 2 * x2) % vocab]

    counts_VVV = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    accepted_at = [0, 0]  # runs whose first verification accepted >= 1, >= 2 drafted tokens
    picker = TokenPicker(Sampling(temperature, top_p, seed=7))
    target = CachedTarget(model, None, picker)
    for run in range(runs):
        picker.start(run)
        generated, _gains, accepted = speculative_generate(target, prompt, drafter, 3)
        counts_VVV[tuple(generated)] += 1
        accepted_at[0] += accepted[0] >= 1
        accepted_at[1] += accepted[0] >= 2
    # both drafted positions were accepted in some runs and rejected in others (422 and 91 of
    # the 1,600 accepted the first, both)
    assert 0.1 * runs < accepted_at[0] < 0.9 * runs
    assert 0.02 * runs < accepted_at[1] < 0.9 * accepted_at[0]

    expected_VVV = exact_VVV * runs
    support = expected_VVV > 0
    assert counts_VVV[~support].sum() == 0  # nothing the target's sampling could not write
    chi2 = ((counts_VVV - expected_VVV)[support] ** 2 / expected_VVV[support]).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(dof, chi2 / 2))
    assert p_value > 1e-6, (float(chi2), int(support.sum()), p_value)


def test_the_log_line_gives_each_seeds_tau() -> None:
    from evaluation.acceptance import AcceptanceResult
    from evaluation.online import _tau_line

    one = AcceptanceResult([2.0, 4.0], forwards=9, new_tokens=30, seconds=3.0, tau_per_seed=[3.0])
    assert _tau_line(one) == "tau 3.000 (10.0 tokens/s)"
    three = AcceptanceResult([2.0, 4.0], 9, 30, seconds=2.0, tau_per_seed=[2.5, 3.25, 3.25])
    assert _tau_line(three) == "tau 3.000 (15.0 tokens/s), per seed 2.500 / 3.250 / 3.250"
