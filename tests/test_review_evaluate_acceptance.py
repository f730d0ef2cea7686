"""Review of `dflash evaluate`'s measurement against references built here, independently of
evaluation/: scripted drafts with accepted counts and tau counted by hand, prompt lookup against
a brute-force n-gram search, what the DFlash drafter is fed at every online step (the tapped
layers' outputs read through forward hooks on a plain uncached forward of the accepted tokens,
the block and its positions through a dense re-derivation of the drafter's forward from the
notes), and the numbers the plot draws.

Legend: T context tokens, K tapped layers, D hidden, B block size, E head dim, V vocab.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from evaluation.acceptance import (
    AcceptanceResult,
    CachedTarget,
    measure_acceptance,
    prompt_lookup_draft,
    speculative_generate,
)
from evaluation.dflash_draft import dflash_draft_fn
from stage2_train.config import DrafterConfig
from stage2_train.model import DFlashDrafter, drafter_shape

TAPPED = [0, 2]
NUM_DRAFT = 5
NUM_NEW = 23
PROMPTS = [
    [5, 17, 42, 8, 5, 17, 42],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3],
]
# per prompt, the draft of each verification step, built from the target's true continuation o
# (w: a token the target does not write there)
SCRIPTS = [
    ["all", "none", "gap", "empty", "short", "last", "all"],
    ["all", "all", "all", "all"],
]
# counted by hand from the scripts: a drafted token is accepted only if every one before it was;
# a step gains accepted + 1 (the target's own token) but never past NUM_NEW (the prefill wrote
# the first new token: 1 + 6+1+3+1+3+5 = 20, so the last "all" of prompt 0 gains 3 of its 6;
# prompt 1: 1 + 6+6+6 = 19, the last gains 4); a step's accepted count is what tau counts of
# it: the drafted tokens among its gains (the last steps: 3 and 4 of their 5 matching drafts)
ACCEPTED = [[5, 0, 2, 0, 2, 4, 3], [5, 5, 5, 4]]
GAINS = [[6, 1, 3, 1, 3, 5, 3], [6, 6, 6, 4]]


def scripted(kind: str, o: list[int], vocab: int) -> list[int]:
    def w(t: int) -> int:
        return (t + 1) % vocab

    return {
        "all": o[:5],
        "none": [w(o[0]), *o[1:5]],  # right after the first miss: still not accepted
        "gap": [o[0], o[1], w(o[2]), o[3], o[4]],
        "empty": [],
        "short": o[:2],
        "last": [*o[:4], w(o[4])],
    }[kind]


def plain_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """Greedy decoding with a full forward per token: no cache of any kind."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def hooked_features(model: torch.nn.Module, tokens: list[int], layers: list[int]) -> torch.Tensor:
    """[T, K, D]: the output of decoder layer i (for i in `layers`) at every token, read by a
    forward hook during one uncached forward of `tokens` (no output_hidden_states indexing)."""
    got: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in layers
    ]
    try:
        with torch.inference_mode():
            model(torch.tensor([tokens]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([got[i][0] for i in layers], 1)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x_NhE: torch.Tensor, positions_N: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [N, heads, E] at `positions_N`."""
    half = x_NhE.size(-1) // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = (positions_N.double()[:, None] * freq)[:, None, :]
    x1, x2 = x_NhE[..., :half].double(), x_NhE[..., half:].double()
    out = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    return out.to(x_NhE.dtype)


def dense_block(
    drafter: DFlashDrafter,
    feats_TKD: torch.Tensor,
    context_positions_T: torch.Tensor,
    block_ids_B: list[int],
    block_positions_B: torch.Tensor,
    embed_VD: torch.Tensor,
) -> torch.Tensor:
    """The drafter's final-normed block states [B, D], derived from notes/dflash.md with the
    drafter's weights: the fused context is K/V (same projections and k_norm) in every layer
    next to the block, Q from the block only, RoPE at the given positions, no mask."""
    s = drafter.shape
    eps, E = s.rms_norm_eps, s.head_dim
    with torch.inference_mode():
        ctx = rms(
            F.linear(feats_TKD.flatten(1), drafter.fc.weight), drafter.hidden_norm.weight, eps
        )
        x = embed_VD[torch.tensor(block_ids_B)]
        kv_positions = torch.cat([context_positions_T, block_positions_B])
        for layer in drafter.layers:
            a = layer.self_attn
            h = rms(x, layer.input_layernorm.weight, eps)
            kv_in = torch.cat([ctx, h])
            q = rms(F.linear(h, a.q_proj.weight).view(len(h), -1, E), a.q_norm.weight, eps)
            k = rms(F.linear(kv_in, a.k_proj.weight).view(len(kv_in), -1, E), a.k_norm.weight, eps)
            v = F.linear(kv_in, a.v_proj.weight).view(len(kv_in), -1, E)
            q, k = rotate(q, block_positions_B, s.rope_theta), rotate(k, kv_positions, s.rope_theta)
            group = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhe,khe->hqk", q, k) / E**0.5
            o = torch.einsum("hqk,khe->qhe", scores.softmax(-1), v).reshape(len(h), -1)
            x = x + F.linear(o, a.o_proj.weight)
            m = layer.mlp
            h = rms(x, layer.post_attention_layernorm.weight, eps)
            x = x + F.linear(
                F.silu(F.linear(h, m.gate_proj.weight)) * F.linear(h, m.up_proj.weight),
                m.down_proj.weight,
            )
        return rms(x, drafter.norm.weight, eps)


class SpyDrafter(DFlashDrafter):
    """The drafter, keeping the block states of every forward."""

    def forward(self, *args):  # type: ignore[override]
        out = super().forward(*args)
        self.outputs.append(out.detach().clone())
        return out


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def spy_drafter(target: torch.nn.Module) -> SpyDrafter:
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=2, block_size=NUM_DRAFT + 1),
        config,
        len(TAPPED),
        config["vocab_size"],
        3,
    )
    torch.manual_seed(0)
    drafter = SpyDrafter(shape).eval()
    drafter.reset_parameters(std=0.2)  # large weights: every input visibly moves the block
    drafter.outputs = []
    return drafter


def checked_dflash(target: torch.nn.Module, drafter: SpyDrafter) -> Callable:
    """`dflash evaluate`'s draft function, each call checked against the references above:
    its features must be the tapped layers' outputs of exactly the accepted tokens but the
    newest, and its block states those of the newest token at position len - 1 over that
    context at positions 0 .. len - 2 (its `calls` counts the checked calls)."""
    embed_VD = target.get_input_embeddings().weight.detach()
    head_VD = target.get_output_embeddings().weight.detach()
    draft = dflash_draft_fn(drafter, embed_VD, head_VD)
    mask, B = drafter.shape.mask_token_id, drafter.shape.block_size

    def check(tokens: list[int], feats_TKD: torch.Tensor) -> list[int]:
        proposal = draft(tokens, feats_TKD)
        want_TKD = hooked_features(target, tokens[:-1], TAPPED)
        torch.testing.assert_close(feats_TKD, want_TKD, rtol=1e-4, atol=1e-5)
        p = len(tokens) - 1
        ids = [tokens[-1]] + [mask] * (B - 1)
        ctx_pos, block_pos = torch.arange(p), torch.arange(p, p + B)
        want_BD = dense_block(drafter, want_TKD, ctx_pos, ids, block_pos, embed_VD)
        got_BD = drafter.outputs[-1]
        torch.testing.assert_close(got_BD, want_BD, rtol=1e-4, atol=1e-4)
        # the reference tells the off-by-ones apart, far beyond that tolerance
        wrong = [
            dense_block(drafter, want_TKD, ctx_pos, ids, block_pos + 1, embed_VD),
            dense_block(drafter, want_TKD[:-1], ctx_pos[:-1], ids, block_pos, embed_VD),
            dense_block(drafter, want_TKD, ctx_pos, [tokens[-2]] + ids[1:], block_pos, embed_VD),
            dense_block(
                drafter,
                hooked_features(target, tokens[:-1], [1, 3]),
                ctx_pos,
                ids,
                block_pos,
                embed_VD,
            ),
        ]
        if tokens[-2] == tokens[-1]:
            wrong.pop(2)
        assert min(float((w - got_BD).abs().max()) for w in wrong) > 1e-2
        assert proposal == (got_BD[1:] @ head_VD.T).argmax(-1).tolist()
        check.calls += 1
        return proposal

    check.calls = 0
    return check


def script_fn(
    prompt: list[int], expected: list[int], kinds: list[str], vocab: int, inner: Callable | None
) -> Callable:
    steps = iter(kinds)

    def draft(tokens: list[int], feats: torch.Tensor | None) -> list[int]:
        if inner is not None:
            inner(tokens, feats)  # the real drafter runs (and is checked), its draft replaced
        done = len(tokens) - len(prompt)
        return scripted(next(steps), expected[done:], vocab)

    return draft


@pytest.mark.parametrize("method", ["target only", "dflash"])
def test_scripted_drafts_count_as_counted_by_hand(target: torch.nn.Module, method: str) -> None:
    """Full accepts, full rejects, a right token after a miss, empty and short drafts, the budget
    ending mid-block: the reply is plain greedy decoding's, accepted counts, gains, histogram,
    acceptance by position and tau are the hand count (tau: mean over prompts of each prompt's
    tokens per forward, the prefill not a forward). With dflash, the real drafter runs at every
    step on the tapped target and its inputs are checked (checked_dflash)."""
    vocab = target.config.vocab_size
    tapped = TAPPED if method == "dflash" else None
    cached = CachedTarget(target, tapped)
    expected = [plain_greedy(target, p, NUM_NEW + NUM_DRAFT + 1) for p in PROMPTS]
    inner = [checked_dflash(target, spy_drafter(target)) if tapped else None for _ in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        draft = script_fn(prompt, expected[i], SCRIPTS[i], vocab, inner[i])
        generated, gains, accepted = speculative_generate(cached, prompt, draft, NUM_NEW)
        assert generated == expected[i][:NUM_NEW]
        assert (accepted, gains) == (ACCEPTED[i], GAINS[i])
        if tapped:
            assert inner[i].calls == len(SCRIPTS[i])
    drafts = iter(script_fn(p, expected[i], SCRIPTS[i], vocab, None) for i, p in enumerate(PROMPTS))
    result = measure_acceptance(cached, PROMPTS, lambda: next(drafts), NUM_NEW, NUM_DRAFT)
    # accepted 5,0,2,0,2,4,3 and 5,5,5,4 (the last step of each cut where tau cuts it)
    assert result.accepted_histogram == [2, 0, 2, 1, 2, 4]
    assert result.acceptance_by_position == pytest.approx([9 / 11, 9 / 11, 7 / 11, 6 / 11, 4 / 11])
    assert result.forwards == 11 and result.new_tokens == 2 * NUM_NEW
    assert result.tau_per_prompt == pytest.approx([22 / 7, 22 / 4])
    assert result.tau == pytest.approx((22 / 7 + 22 / 4) / 2)  # not pooled: 44 / 11 = 4


def test_a_stop_token_inside_an_accepted_block(target: torch.nn.Module) -> None:
    """A block fully accepted past the end of sequence: the reply is plain greedy up to and
    with the stop token; the step gains the tokens up to it only, so tau leaves out what the
    target accepted after it, and so do the histogram and acceptance by position: the step
    counts the drafted tokens up to the stop token, not the matching drafts after it. The
    DFlash path, its inputs checked."""
    prompt = PROMPTS[1]
    expected = plain_greedy(target, prompt, NUM_NEW + NUM_DRAFT + 1)
    # a stop token first written as the 2nd to 4th drafted token of the second block (new token
    # 1 + 6 + 2..4), so that the block's matching drafts run past it
    k = next((i for i in range(8, 11) if expected[i] not in expected[:i]), None)
    assert k is not None, "the tiny target repeats itself: pick another prompt"
    stop = frozenset({expected[k]})
    inner = checked_dflash(target, spy_drafter(target))
    draft = script_fn(prompt, expected, ["all"] * 3, target.config.vocab_size, inner)
    generated, gains, accepted = speculative_generate(
        CachedTarget(target, TAPPED), prompt, draft, NUM_NEW, stop_ids=stop
    )
    assert generated == expected[: k + 1]
    assert gains == [6, k - 6] and accepted == [5, k - 6] and inner.calls == 2
    drafts = iter([script_fn(prompt, expected, ["all"] * 3, target.config.vocab_size, None)])
    result = measure_acceptance(
        CachedTarget(target, None),
        [prompt],
        lambda: next(drafts),
        NUM_NEW,
        NUM_DRAFT,
        stop_ids=stop,
    )
    assert result.tau == pytest.approx(k / 2) and result.new_tokens == k + 1
    assert result.stopped_at_eos == 1
    histogram = [0] * (NUM_DRAFT + 1)
    histogram[5] += 1
    histogram[k - 6] += 1  # the drafted tokens up to and with the stop token (2 to 4)
    assert result.accepted_histogram == histogram
    by_position = [(1 + (k - 6 >= j)) / 2 for j in range(1, NUM_DRAFT + 1)]
    assert result.acceptance_by_position == pytest.approx(by_position)


def brute_force_lookup(tokens: list[int], num_draft: int) -> list[int]:
    """Prompt lookup as quality.md states it: the longest suffix n-gram (n = 4..1) that occurred
    earlier (its occurrence ending before the last token), the continuation of its latest
    occurrence, up to num_draft tokens."""
    for n in (4, 3, 2, 1):
        if n < len(tokens):
            suffix = tokens[-n:]
            ends = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if ends:
                return tokens[max(ends) : max(ends) + num_draft]
    return []


def test_prompt_lookup_equals_a_brute_force_search() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 12])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        num_draft = rng.choice([1, 3, 15])
        want = brute_force_lookup(tokens, num_draft)
        assert prompt_lookup_draft(tokens, num_draft) == want, (tokens, num_draft)
        checked += bool(want)
    assert checked > 2000
    # a 5-gram match does not outrank the latest 4-gram match: n stops at 4
    tokens = [1, 2, 3, 4, 5, 8, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]
    assert prompt_lookup_draft(tokens, 2) == [9, 1]


def test_the_plot_draws_the_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left: acceptance_by_position at k = 1..num_draft per method; right: the histogram as
    fractions of forwards, the methods' bars side by side at each count."""
    from matplotlib.figure import Figure

    from evaluation.plot import plot_acceptance

    figures: list[Figure] = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1]
    )
    lookup = AcceptanceResult([1.5], forwards=4, new_tokens=6, accepted_histogram=[2, 1, 1, 0])
    dflash = AcceptanceResult([3.0], forwards=5, new_tokens=15, accepted_histogram=[0, 1, 1, 3])
    results = {
        "num_prompts": 1,
        "new_tokens": 6,
        "prompt_lookup": lookup.to_json(),
        "dflash": dflash.to_json(),
    }
    plot_acceptance(results, tmp_path / "plot.png")
    (fig,) = figures
    by_position, histogram = fig.axes[:2]
    for line, result in zip(by_position.lines, (lookup, dflash), strict=True):
        assert line.get_xdata().tolist() == [1, 2, 3]
        assert line.get_ydata().tolist() == pytest.approx(result.acceptance_by_position)
    assert [line.get_label() for line in by_position.lines] == [
        "prompt lookup (tau 1.50)",
        "DFlash (tau 3.00)",
    ]
    bars = [(round(b.get_x() + b.get_width() / 2, 6), b.get_height()) for b in histogram.patches]
    want = [(a - 0.2, c / 4) for a, c in enumerate([2, 1, 1, 0])]
    want += [(a + 0.2, c / 5) for a, c in enumerate([0, 1, 1, 3])]
    assert [x for bar in bars for x in bar] == pytest.approx([x for bar in want for x in bar])
