"""Online acceptance: speculative decoding must reproduce plain greedy decoding exactly,
whatever the drafter proposes; prompt lookup and DFlash drafts are checked against references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from evaluation.acceptance import (
    TappedTarget,
    dflash_draft_fn,
    measure_acceptance,
    prompt_lookup_draft,
    speculative_generate,
)
from stage2_train.config import DrafterConfig
from stage2_train.model import DFlashDrafter, drafter_shape


def greedy_reference(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def test_prompt_lookup_copies_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] (n=2; n>=3 never occurred before): latest earlier match at index 5 -> 7, 8, 5
    assert prompt_lookup_draft(tokens, 3) == [7, 8, 5]
    assert prompt_lookup_draft([4, 5, 6], 3) == []


@pytest.mark.parametrize("drafter", ["oracle", "wrong", "lookup"])
def test_speculative_output_equals_greedy(target: torch.nn.Module, drafter: str) -> None:
    prompt = [5, 17, 42, 8, 5, 17, 42]
    expected = greedy_reference(target, prompt, 24)

    def draft(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        done = len(tokens) - len(prompt)
        if drafter == "oracle":
            return expected[done : done + 7]
        if drafter == "wrong":
            return [(t + 1) % 100 for t in expected[done : done + 7]]
        return prompt_lookup_draft(tokens, 7)

    generated, gains = speculative_generate(TappedTarget(target, None), prompt, draft, 24)
    assert generated == expected
    assert sum(gains) == 23  # the prefill forward gives the first token
    if drafter == "oracle":
        assert len(gains) <= 3  # 7 accepted + 1 bonus per forward
    if drafter == "wrong":
        assert all(g == 1 for g in gains)


def test_dflash_drafter_keeps_greedy_output(target: torch.nn.Module) -> None:
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), config, 2, config["vocab_size"], 3
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape).eval()
    draft = dflash_draft_fn(
        drafter, target.get_input_embeddings().weight, target.get_output_embeddings().weight
    )
    prompt = [5, 17, 42, 8, 5, 17, 42]
    expected = greedy_reference(target, prompt, 12)
    tapped = TappedTarget(target, [0, 2])
    generated, gains = speculative_generate(tapped, prompt, draft, 12)
    assert generated == expected
    proposals = draft(prompt + expected[:1], tapped(prompt)[1])
    assert len(proposals) == shape.block_size - 1
    result = measure_acceptance(tapped, [prompt], draft, 12)
    assert result.tau == pytest.approx(11 / len(gains))


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
    assert figures["num_prompts"] == 2
    for method in ("prompt_lookup", "dflash"):
        assert len(figures[method]["tau_per_prompt"]) == 2
        assert 1.0 <= figures[method]["tau"] <= 6.0
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
