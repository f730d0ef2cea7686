"""The stop ids `chained_tau` counts a reply's stop token by are those `dflash evaluate` (and
`dflash generate`) stop at: the tokenizer's and the generation config's end of sequence and the
chat template's end of turn. Qwen3's generation config lists `<|endoftext|>` besides the
tokenizer's `<|im_end|>`; chained looked only at the tokenizer's and the target config's, so a
text or completion reply ended by such an id (and not holding it) was not extended by it and
its figure departed from online. Generate records the ids (manifest `stop_ids`, copied into the
store's `generation`), and chained reads them there.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from common.store import open_store
from evaluation import chained
from evaluation.acceptance import CachedTarget, prompt_lookup_draft, speculative_generate
from evaluation.online import reply_stop_ids
from stage1_extract.run import run_extract
from stage1_generate.run import run_generate
from tests.test_chained import PROMPTS, _stored_row, oracle_chains
from tests.test_generate import config, extract_config, write_jsonl


@pytest.fixture(scope="module")
def extra_eos_target(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3 whose generation_config.json lists, besides the tokenizer's end of sequence,
    a token it writes a few tokens into its replies to PROMPTS (as Qwen3's lists
    `<|endoftext|>`): its replies end there. The target config names no end of sequence."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    ends: Counter[int] = Counter()  # token -> replies where it first comes at step 3 or later
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        reply, _, _ = speculative_generate(CachedTarget(model, None), prompt, lambda t, f: [], 24)
        ends.update(t for k, t in enumerate(reply) if k >= 3 and t not in reply[:k])
    extra, count = ends.most_common(1)[0]
    assert count >= 2, "no token ends two replies"
    out = tmp_path_factory.mktemp("extra-eos")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert extra != tokenizer.eos_token_id and model.config.eos_token_id is None
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, extra]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def store_attrs(extra_eos_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The root attributes of a store extracted from `dflash generate`'s completion rows."""
    tmp = tmp_path_factory.mktemp("extra-eos-store")
    data = write_jsonl(tmp / "rows.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS])
    run_generate(config(extra_eos_target, data, tmp / "gen", "sampling.max_new_tokens=24"))
    run_extract(extract_config(extra_eos_target, tmp / "gen", tmp / "store"))
    return open_store(tmp / "store").attrs


def _online_stops(target_dir: Path) -> frozenset[int]:
    """The ids `dflash evaluate` stops at (its default, no chat template kwargs)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return reply_stop_ids(model, AutoTokenizer.from_pretrained(target_dir), {})


def test_generate_records_the_stop_ids_evaluate_stops_at(
    extra_eos_target: Path, store_attrs: dict
) -> None:
    online = _online_stops(extra_eos_target)
    extra = json.loads((extra_eos_target / "generation_config.json").read_text())["eos_token_id"]
    assert set(extra) <= online  # the generation config's ids are among them
    assert store_attrs["generation"]["stop_ids"] == sorted(online)
    assert chained.unstored_stop_ids(store_attrs) == online


def test_chained_counts_a_stop_only_the_generation_config_names_as_online(
    extra_eos_target: Path, store_attrs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies the target ended at the generation config's extra end of sequence, stored
    without it (other data, an earlier generate, a stop whose text would not read back as its
    id): offline, prompt lookup's chain and a drafter's chain (an oracle: the block's labels)
    gain per response what `dflash evaluate` gains online, the stop included."""
    tokenizer = AutoTokenizer.from_pretrained(extra_eos_target)
    target = AutoModelForCausalLM.from_pretrained(extra_eos_target, dtype=torch.float32).eval()
    online_stops = _online_stops(extra_eos_target)
    offline_stops = chained.unstored_stop_ids(store_attrs)
    monkeypatch.setattr(chained, "forward_batch", lambda m, h, batch, **k: batch.labels_AB)
    monkeypatch.setattr(chained, "greedy_predictions", lambda hidden, head, chunk: hidden)
    block_size, compared = 4, 0
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        generated, _, _ = speculative_generate(
            CachedTarget(target, None), prompt, lambda t, f: [], 24, stop_ids=online_stops
        )
        if generated[-1] not in online_stops - {tokenizer.eos_token_id} or len(generated) < 4:
            continue  # not a reply the extra end of sequence ended
        reply, compared = generated[:-1], compared + 1
        row = _stored_row(target, prompt, reply)

        def lookup(tokens: list[int], _f: torch.Tensor | None) -> list[int]:
            return prompt_lookup_draft(tokens, block_size - 1)

        _, gains, _ = speculative_generate(
            CachedTarget(target, None), prompt, lookup, 64, stop_ids=online_stops
        )
        offline = chained.prompt_lookup_chains([row], block_size - 1, stop_ids=offline_stops)
        assert offline == [(sum(gains), len(gains))]

        offline, gains = oracle_chains(
            target, prompt, generated, row, block_size, online_stops, offline_stops
        )
        assert offline == [(sum(gains), len(gains))]
        assert sum(gains) == len(reply)  # every token after the first, the stop included
    assert compared >= 2
