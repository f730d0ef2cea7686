"""Online acceptance: speculative decoding must reproduce plain greedy decoding exactly,
whatever the drafter proposes, and the cached path (target KV cache, feature buffer, drafter
context cache) must accept exactly the tokens of the recompute reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from evaluation.acceptance import (
    AcceptanceResult,
    CachedTarget,
    DraftFn,
    measure_acceptance,
    prompt_lookup_draft,
    speculative_generate,
)
from evaluation.dflash_draft import dflash_draft_fn
from evaluation.reference import TappedTarget, reference_dflash_draft_fn, reference_generate
from stage2_train.config import DrafterConfig
from stage2_train.model import DFlashDrafter, drafter_shape

PROMPTS = [
    [5, 17, 42, 8, 5, 17, 42],
    [9, 9, 9, 9, 9, 9, 9, 9],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7],
]


def greedy_reference(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def tiny_drafter(target: torch.nn.Module, block_size: int = 4) -> DFlashDrafter:
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=2, block_size=block_size), config, 2, config["vocab_size"], 3
    )
    torch.manual_seed(0)
    return DFlashDrafter(shape).eval()


def test_prompt_lookup_copies_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] (n=2; n>=3 never occurred before): latest earlier match at index 5 -> 7, 8, 5
    assert prompt_lookup_draft(tokens, 3) == [7, 8, 5]
    assert prompt_lookup_draft([4, 5, 6], 3) == []


@pytest.mark.parametrize("drafter", ["oracle", "wrong", "lookup"])
def test_speculative_output_equals_greedy(target: torch.nn.Module, drafter: str) -> None:
    prompt = PROMPTS[0]
    expected = greedy_reference(target, prompt, 24)

    def draft(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        done = len(tokens) - len(prompt)
        if drafter == "oracle":
            return expected[done : done + 7]
        if drafter == "wrong":
            return [(t + 1) % 100 for t in expected[done : done + 7]]
        return prompt_lookup_draft(tokens, 7)

    generated, gains, accepted = speculative_generate(CachedTarget(target, None), prompt, draft, 24)
    assert generated == expected
    assert sum(gains) == 23  # the prefill forward gives the first token
    if drafter == "oracle":
        assert len(gains) <= 3  # 7 accepted + 1 bonus per forward
        assert accepted[0] == 7
    if drafter == "wrong":
        assert all(g == 1 for g in gains) and not any(accepted)


def recording(
    draft_fn: DraftFn, log: list[list[int]], oracle: list[int], prompt_len: int
) -> DraftFn:
    """Record every proposal of `draft_fn`, then hand the target a draft of the true greedy
    continuation for (step mod 4) tokens, one wrong token, then the proposal: exactly that many
    accepted, and rejected tokens every step, so the target's cache is cropped by varying
    amounts and the drafter's context grows by 1 to 4 rows a step."""

    def draft(tokens: list[int], feats: torch.Tensor | None) -> list[int]:
        proposal = draft_fn(tokens, feats)
        log.append(proposal)
        done = len(tokens) - prompt_len
        keep = len(log) % 4
        wrong = (oracle[done + keep] + 1) % 100
        return [*oracle[done : done + keep], wrong, *proposal][:5]

    return draft


@pytest.mark.parametrize("method", ["lookup", "dflash"])
def test_cached_path_equals_recompute_reference(target: torch.nn.Module, method: str) -> None:
    drafter = tiny_drafter(target, block_size=6)
    embed_VD = target.get_input_embeddings().weight
    head_VD = target.get_output_embeddings().weight
    tapped = [0, 2] if method == "dflash" else None
    cached_target, reference_target = CachedTarget(target, tapped), TappedTarget(target, tapped)
    for prompt in PROMPTS:
        oracle = greedy_reference(target, prompt, 24)
        if method == "dflash":
            cached_draft = dflash_draft_fn(drafter, embed_VD, head_VD)
            reference_draft = reference_dflash_draft_fn(drafter, embed_VD, head_VD)
        else:
            cached_draft = reference_draft = lambda toks, _f: prompt_lookup_draft(toks, 5)  # noqa: E731
        cached_log: list[list[int]] = []
        reference_log: list[list[int]] = []
        cached = speculative_generate(
            cached_target, prompt, recording(cached_draft, cached_log, oracle, len(prompt)), 20
        )
        reference = reference_generate(
            reference_target,
            prompt,
            recording(reference_draft, reference_log, oracle, len(prompt)),
            20,
        )
        runs = {"cached": (*cached, cached_log), "reference": (*reference, reference_log)}
        assert runs["cached"] == runs["reference"]
        generated, gains, accepted, proposals = runs["cached"]
        assert generated == oracle[:20]
        assert accepted[:4] == [1, 2, 3, 0], accepted
        if method == "dflash":
            assert all(len(p) == 5 for p in proposals)
            # the buffer holds the target's features of every token but the newest
            _, feats_TKD = reference_target([*prompt, *generated], 1)
            assert cached_target.features is not None
            torch.testing.assert_close(cached_target.features, feats_TKD[:-1], rtol=1e-4, atol=1e-5)


def test_acceptance_by_position_from_histogram(target: torch.nn.Module) -> None:
    result = AcceptanceResult([2.0], forwards=4, new_tokens=8, accepted_histogram=[1, 1, 0, 2])
    # 4 forwards accepted 0, 1, 3, 3 drafted tokens: >= 1 in 3, >= 2 in 2, >= 3 in 2
    assert result.acceptance_by_position == [0.75, 0.5, 0.5]
    oracle = greedy_reference(target, PROMPTS[0], 9)
    measured = measure_acceptance(
        CachedTarget(target, None),
        [PROMPTS[0]],
        lambda: lambda toks, _f: oracle[len(toks) - 7 :][:3],
        9,
        3,
    )
    # 1 token from the prefill, then 3 accepted + 1 bonus twice
    assert measured.accepted_histogram == [0, 0, 0, 2] and measured.tau == 4.0
    assert measured.acceptance_by_position == [1.0, 1.0, 1.0]


def test_reply_ends_at_a_stop_token(target: torch.nn.Module) -> None:
    """With stop ids, decoding ends at the first one the target writes (kept); drafted tokens
    accepted past it are dropped; a reply that is the stop token alone verifies nothing and is
    left out of tau (counted apart)."""
    prompt = PROMPTS[2]
    expected = greedy_reference(target, prompt, 20)
    # a token first written at step k >= 2 (a later repeat must not matter)
    k = next(i for i in range(2, 20) if expected[i] not in expected[:i])
    stop = frozenset({expected[k]})

    def oracle(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        done = len(tokens) - len(prompt)
        return expected[done : done + 7]  # always right, past the stop too

    generated, gains, _ = speculative_generate(
        CachedTarget(target, None), prompt, oracle, 20, stop_ids=stop
    )
    assert generated == expected[: k + 1] and sum(gains) == k  # the prefill gave the first
    at_once = frozenset({expected[0]})
    generated, gains, _ = speculative_generate(
        CachedTarget(target, None), prompt, oracle, 20, stop_ids=at_once
    )
    assert generated == expected[:1] and gains == []
    measured = measure_acceptance(
        CachedTarget(target, None), [prompt, PROMPTS[0]], lambda: oracle, 20, 7, stop_ids=at_once
    )
    assert measured.ended_at_prefill == [0] and len(measured.tau_per_prompt) == 1
    assert measured.stopped_at_eos >= 1


def test_stop_ids_and_template_kwargs(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A reply ends where `dflash generate` ends one (the generation config's and tokenizer's
    end of sequence, the template's end of turn); template kwargs reach the prompts."""
    import json

    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, load_prompts, reply_stop_ids

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [7, 11]  # a chat target's list
    assert reply_stop_ids(model, tokenizer, {}) == {7, 11, tokenizer.eos_token_id, end_of_turn}
    model.generation_config.eos_token_id = None
    assert end_of_turn in reply_stop_ids(model, tokenizer, {})

    tokenizer.chat_template = (
        "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
        + tokenizer.chat_template
    )
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    chat.write_text(json.dumps({"messages": turns}) + "\n")
    cfg = EvaluateConfig(str(tiny_qwen3), str(chat))
    assert "NOTHINK" not in tokenizer.decode(load_prompts(cfg, tokenizer)[0])
    cfg.chat_template_kwargs = {"enable_thinking": False}
    assert tokenizer.decode(load_prompts(cfg, tokenizer)[0]).startswith("NOTHINK")


def test_every_reply_ending_at_once_is_a_clear_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    import json

    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, _evaluate, load_prompts

    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    cfg = EvaluateConfig(str(tiny_qwen3), str(data), new_tokens=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    (prompt,) = load_prompts(cfg, tokenizer)
    model.generation_config.eos_token_id = greedy_reference(model, prompt, 1)  # its first token
    with pytest.raises(ValueError, match="ended every reply at once.*--no-stop-at-eos"):
        _evaluate(cfg, model, tokenizer, None)
    cfg.stop_at_eos = False
    assert len(_evaluate(cfg, model, tokenizer, None)["prompt_lookup"]["tau_per_prompt"]) == 1


def assert_png(path: Path) -> None:
    """A PNG by its magic bytes, that matplotlib decodes into an RGB(A) image."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4) and min(pixels.shape[:2]) > 100


def test_plot_writes_png(tmp_path: Path) -> None:
    from evaluation.plot import plot_acceptance

    lookup = AcceptanceResult([1.5], forwards=4, new_tokens=6, accepted_histogram=[2, 1, 1])
    results = {"num_prompts": 1, "new_tokens": 6, "prompt_lookup": lookup.to_json()}
    assert_png(plot_acceptance(results, tmp_path / "sub" / "plot.png"))


def test_evaluate_command_reports_both_methods(tiny_qwen3: Path, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from dflash_offline.cli import main
    from stage2_train.export import export_drafter

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), config, 2, config["vocab_size"], 3
    )
    export = export_drafter(DFlashDrafter(shape), shape, [0, 2], config, tmp_path / "export")
    data = tmp_path / "dev.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x\n"}) + "\n" for i in range(3))
    )
    out = tmp_path / "acc.json"
    result = CliRunner().invoke(
        main,
        [
            "evaluate",
            "--target",
            str(tiny_qwen3),
            "--drafter",
            str(export),
            "--data",
            str(data),
            "--num-prompts",
            "2",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "6",
            "--json-out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["num_prompts"] == 2 and figures["num_draft"] == 3  # the drafter's block - 1
    assert figures["stop_at_eos"] is True
    assert figures["stop_ids"] and all(isinstance(i, int) for i in figures["stop_ids"])
    past_end = CliRunner().invoke(
        main,
        ["evaluate", "--target", str(tiny_qwen3), "--data", str(data), "--num-prompts", "1"]
        + ["--new-tokens", "4", "--no-stop-at-eos"],
    )
    assert past_end.exit_code == 0, past_end.output
    past_figures = json.loads(past_end.stdout)
    assert past_figures["stop_at_eos"] is False and past_figures["stop_ids"] == []
    bad = CliRunner().invoke(
        main, ["evaluate", "--target", "t", "--data", "d", "--chat-template-kwargs", "[1]"]
    )
    assert bad.exit_code == 2 and "is not a JSON object" in bad.output
    for method in ("prompt_lookup", "dflash"):
        result = figures[method]
        assert len(result["tau_per_prompt"]) == 2
        assert 1.0 <= result["tau"] <= 6.0
        assert len(result["accepted_histogram"]) == 4
        assert sum(result["accepted_histogram"]) == result["forwards"]
        by_position = result["acceptance_by_position"]
        assert len(by_position) == 3 and by_position == sorted(by_position, reverse=True)
    assert_png(out.with_suffix(".png"))  # beside the JSON by default
    chat = tmp_path / "chat.jsonl"
    conversation = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
    ]
    chat.write_text(json.dumps({"messages": conversation}) + "\n")
    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    (prompt,) = load_prompts(EvaluateConfig(str(tiny_qwen3), str(chat)), tokenizer)
    expected = tokenizer.apply_chat_template(
        conversation[:3], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(prompt) == expected  # history up to the last answer, then its header
    missing = CliRunner().invoke(
        main,
        [
            "evaluate",
            "--target",
            str(tiny_qwen3),
            "--data",
            str(tmp_path / "nope.jsonl"),
        ],
    )
    assert missing.exit_code == 2 and "does not exist" in missing.output
    not_export = CliRunner().invoke(
        main,
        ["evaluate", "--target", str(tiny_qwen3), "--data", str(chat), "--drafter", str(tmp_path)],
    )
    assert (
        not_export.exit_code == 2 and "config.json, model.safetensors missing" in not_export.output
    )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": ""}, r"row 1: the prompt is empty"),
        (
            {"messages": [{"role": "assistant", "content": "hi"}]},
            r"row 1: the chat template failed",
        ),
    ],
)
def test_bad_prompt_rows_are_named(
    tiny_qwen3: Path, tmp_path: Path, row: dict, message: str
) -> None:
    """An empty prompt used to fail inside the target's forward (a float index tensor) after
    the earlier prompts had run; a template error was the bare Jinja message."""
    import json

    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, load_prompts

    first = (
        {"text": "hello there"}
        if "text" in row
        else {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        }
    )
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps(first) + "\n" + json.dumps(row) + "\n")
    cfg = EvaluateConfig(target=str(tiny_qwen3), data=str(data))
    with pytest.raises(ValueError, match=message):
        load_prompts(cfg, AutoTokenizer.from_pretrained(tiny_qwen3))


def test_a_chat_prompt_ending_in_a_user_turn_is_answered_there(
    tiny_qwen3: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversation whose last message is a user turn: the prompt is all of it (the pending
    question is what the model answers), not the history before an earlier assistant turn; a
    prompt cut to --prompt-tokens is said in the log."""
    from transformers import AutoTokenizer

    from common.logging import get_logger
    from evaluation.online import EvaluateConfig, load_prompts

    conversation = [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "Roses are red."},
        {"role": "user", "content": "Now translate it to French."},
    ]
    import json

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": conversation}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    (prompt,) = load_prompts(EvaluateConfig(str(tiny_qwen3), str(chat)), tokenizer)
    expected = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(prompt) == expected
    cfg = EvaluateConfig(str(tiny_qwen3), str(chat))
    cfg.prompt_tokens = 8
    log = get_logger()  # (it may not propagate to the root logger caplog reads)
    log.addHandler(caplog.handler)
    try:
        (short,) = load_prompts(cfg, tokenizer)
    finally:
        log.removeHandler(caplog.handler)
    assert short == tokenizer(expected, add_special_tokens=False)["input_ids"][-8:]
    assert "1 of 1 chat prompts cut to their last 8 tokens" in caplog.text


def test_chat_prompts_render_as_extract_renders_them(tiny_qwen3: Path, tmp_path: Path) -> None:
    """evaluate's chat prompts go through extract's message normalisation: content given as
    OpenAI's list of text parts is their text (it rendered as a Python list), the None Arrow
    fills in for a key only another row has is dropped (a template testing `is defined` took
    it), and a message that cannot be one names its row."""
    import json

    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.name is defined %}NAMED:{{ m.name }}|{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
        "{% endif %}"
    )
    parts = [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Twice."}]
    rows = [
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Yo."}]},
        {"messages": [{"role": "user", "content": "Bye.", "name": "ann"}]},
    ]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = load_prompts(EvaluateConfig(str(tiny_qwen3), str(chat)), tokenizer)
    # Arrow gave the first row's user message name=None: it must not render as NAMED:None
    assert tokenizer.decode(first) == "user: Hi.\nTwice.\nassistant:"
    assert tokenizer.decode(second) == "NAMED:ann|user: Bye.\nassistant:"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": image}]}) + "\n")
    with pytest.raises(ValueError, match=r"chat.jsonl row 0: message 0 content has a part"):
        load_prompts(EvaluateConfig(str(tiny_qwen3), str(chat)), tokenizer)
