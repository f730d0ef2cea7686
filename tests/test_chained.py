"""Chained offline acceptance (`evaluation/chained.py`) against online decoding: on a store of
the target's own greedy continuation of some prompts, the chain of anchors followed from the
stored features gains, response by response, what `dflash evaluate` gains online."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, target_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import build_config
from evaluation.acceptance import CachedTarget, prompt_lookup_draft, speculative_generate
from evaluation.chained import response_runs
from evaluation.dflash_draft import dflash_draft_fn
from evaluation.offline import OfflineEvalConfig, run_offline_eval
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract
from stage2_train.config import DrafterConfig, TrainConfig
from stage2_train.export import load_export, served_copy
from stage2_train.model import DFlashDrafter, drafter_shape
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
PROMPTS = [
    "What is a prime number? A prime number is",
    "Give me a short tip for writing clear emails.",
    "How long should I boil an egg for a soft yolk?",
    "Name three colors of the rainbow",
]
NEW_TOKENS = 24


def prompt_lookup_online(
    target: torch.nn.Module,
    prompt: list[int],
    num_draft: int,
    num_new: int,
    stop_ids: frozenset[int] = frozenset(),
) -> tuple[list[int], list[int]]:
    """Prompt lookup under the target's greedy verification, as `dflash evaluate` runs it:
    (the tokens generated, the tokens gained per forward)."""
    generated, gains, _ = speculative_generate(
        CachedTarget(target, None),
        prompt,
        lambda tokens, _f: prompt_lookup_draft(tokens, num_draft),
        num_new,
        stop_ids=stop_ids,
    )
    return generated, gains


def test_response_runs() -> None:
    loss = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1])
    docs = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, -1, 2])
    # a run ends at a document change; runs shorter than two tokens are dropped
    assert response_runs(loss, docs).tolist() == [[1, 4], [5, 7], [7, 9]]


def test_chained_offline_tau_equals_online(tiny_qwen3: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    greedy = CachedTarget(target, None)
    rows, prompts, completions = [], [], []
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        generated, _, _ = speculative_generate(greedy, prompt, lambda t, f: [], NEW_TOKENS)
        completion = tokenizer.decode(generated, skip_special_tokens=True)
        # the store re-tokenizes text: keep the rows whose ids survive the round trip
        if tokenizer(completion, add_special_tokens=False)["input_ids"] != generated:
            continue
        rows.append({"prompt": text, "completion": completion})
        prompts.append(prompt)
        completions.append(generated)
    assert len(rows) >= 2, "too few prompts round-trip through the tokenizer"
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    store, run = tmp_path / "store", tmp_path / "run"
    sets = [f"target.model={tiny_qwen3}", f"data.path={data}", f"store.out={store}"]
    sets += ["store.hidden_dtype=bfloat16"]  # the online side below rounds features to bf16
    run_extract(build_config(ExtractConfig, DEBUG, "extract", [*sets, "run.progress=false"]))
    train_sets = [f"data.store={store}", f"run.out={run}", "optim.max_steps=30"]
    train_sets += ["data.holdout_sequences=0", "run.progress=false", f"data.dev_store={store}"]
    # mixed (bf16 autocast, bf16 head) as on GPUs: the figure must still be the served one
    train_sets += ["run.dtype=mixed"]
    run_train(build_config(TrainConfig, DEBUG, "train", train_sets))
    # data.dev_store: the training log carries the chained figure at every evaluation
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["dev_chained_tau"] >= 1.0

    offline = run_offline_eval(OfflineEvalConfig(str(run / "export"), str(store)))
    # the training log's figure is the export's, computed as `dflash evaluate` serves it
    assert last["dev_chained_tau"] == offline["chained_tau"]

    drafter = load_export(run / "export").float().eval()
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    tapped = json.loads((run / "export" / "config.json").read_text())["dflash_config"]
    online = CachedTarget(target, tapped["target_layer_ids"])
    taus = []
    for prompt, completion in zip(prompts, completions, strict=True):
        draft = dflash_draft_fn(drafter, embed, head)

        def from_stored_precision(tokens: list[int], feats: torch.Tensor, draft=draft) -> list[int]:
            return draft(tokens, feats.to(torch.bfloat16).float())  # the store keeps bf16

        generated, gains, _ = speculative_generate(
            online, prompt, from_stored_precision, len(completion)
        )
        assert generated == completion  # greedy speculative decoding is lossless
        taus.append(sum(gains) / len(gains))
    assert offline["chained_responses"] == len(rows)
    # responses come in packing order: compare as multisets
    assert sorted(offline["chained_tau_per_response"]) == pytest.approx(sorted(taus), abs=1e-3)
    assert max(taus) > 2  # the drafter accepts something: the chain is really exercised
    assert offline["chained_tau"] == pytest.approx(sum(taus) / len(taus), abs=1e-3)

    # prompt lookup offline (no model: the stored text and argmax) = prompt lookup online
    num_draft = drafter.shape.block_size - 1
    lookup_taus = []
    for prompt, completion in zip(prompts, completions, strict=True):
        generated, gains = prompt_lookup_online(target, prompt, num_draft, len(completion))
        assert generated == completion
        lookup_taus.append(sum(gains) / len(gains))
    assert offline["prompt_lookup_chained_responses"] == len(rows)
    assert sorted(offline["prompt_lookup_chained_tau_per_response"]) == pytest.approx(
        sorted(lookup_taus), abs=1e-3
    )
    assert max(lookup_taus) > 1  # some drafted token is accepted: the chain is exercised


def test_served_copy_rounds_like_the_export() -> None:
    """The copy the training log's dev figure runs: every weight as the bf16 export holds it,
    computing in fp32, and no tie to the training parameters."""
    torch.manual_seed(0)
    spec = FactorySpec()
    shape = drafter_shape(DrafterConfig(num_layers=2), target_config(spec), 3, spec.vocab_size, 3)
    model = DFlashDrafter(shape)
    twin = served_copy(model)
    assert not twin.training
    for (name, p), (twin_name, q) in zip(
        model.named_parameters(), twin.named_parameters(), strict=True
    ):
        assert name == twin_name and q.dtype == torch.float32
        assert torch.equal(q, p.detach().to(torch.bfloat16).float())
        assert q.data_ptr() != p.data_ptr()
    assert any(
        not torch.equal(q, p) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
    )


def test_a_dev_store_of_many_batches_keeps_the_attention_to_few_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo keeps one compiled attention graph per shape and refuses past its recompile
    limit (8): a dev store whose batches hold different numbers of responses, and a short last
    batch, must reach the attention in a few shapes; the chains are the same either way (a
    response's chain does not depend on its batch)."""
    from store_factory import build_store

    from common.store import open_store
    from evaluation import chained
    from stage2_train.step import load_frozen_head

    spec = FactorySpec(num_sequences=75, sequences_per_shard=25, min_doc_len=6, max_doc_len=60)
    path = build_store(tmp_path / "store", spec)
    info = open_store(str(path), require_complete=True)
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), target_config(spec), 2, spec.vocab_size, 3
    )
    torch.manual_seed(0)
    model = DFlashDrafter(shape).eval()
    head = load_frozen_head(str(path), torch.device("cpu"), torch.float32)
    shapes: set[tuple[int, int]] = set()
    forward = chained.forward_batch

    def recording(model, head, batch, **kwargs):  # noqa: ANN001, ANN202
        shapes.add((batch.tokens_T.numel(), batch.anchors_A.numel()))
        return forward(model, head, batch, **kwargs)

    monkeypatch.setattr(chained, "forward_batch", recording)
    # the shapes the flex backend would get, through the dense path (flex runs on a GPU)
    settings = dict(block_size=4, mask_token_id=3, backend="sdpa", chunk_tokens=64)
    settings["fixed_shapes"] = True
    batched = chained.chained_tau_on_store(
        model, head, info, batch_sequences=8, device=torch.device("cpu"), **settings
    )
    assert len(shapes) <= 3, sorted(shapes)  # 10 batches of 8, the last of 3 made 8 long
    whole = chained.chained_tau_on_store(
        model, head, info, batch_sequences=75, device=torch.device("cpu"), **settings
    )
    assert batched["chained_tau_per_response"] == whole["chained_tau_per_response"]
    assert batched["chained_responses"] > 75


def _reply_ending_at_a_stop(
    target: torch.nn.Module, prompt: list[int]
) -> tuple[list[int], int] | None:
    """The target's greedy reply to `prompt` up to a token that stands in for its end of
    sequence (the last token of its first 24 that it did not write before, at step 4 or later),
    and that token: the tiny target never writes its real one. None if there is none."""
    generated, _, _ = speculative_generate(CachedTarget(target, None), prompt, lambda t, f: [], 24)
    new = [k for k in range(4, len(generated)) if generated[k] not in generated[:k]]
    return (generated[: new[-1]], generated[new[-1]]) if new else None


def _stored_row(target: torch.nn.Module, prompt: list[int], reply: list[int]) -> dict:
    """What extract stores of a {prompt, completion} row: the reply's tokens without the stop
    token that ended it (generate drops it), loss on the reply, the target's argmax everywhere."""
    tokens = torch.tensor(prompt + reply)
    with torch.no_grad():
        argmax = target(tokens[None]).logits[0].argmax(-1)
    n = len(tokens)
    return {
        "tokens": tokens.int(),
        "position_ids": torch.arange(n, dtype=torch.int32),
        "document_ids": torch.zeros(n, dtype=torch.int32),
        "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(reply), dtype=torch.uint8),
        "target_argmax": argmax.int(),
        "hidden": torch.zeros(n, 1, 1, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def replies_ending_at_a_stop(
    tiny_qwen3: Path, target: torch.nn.Module
) -> list[tuple[list[int], list[int], int, dict]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    out = []
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        if found := _reply_ending_at_a_stop(target, prompt):
            reply, stop = found
            out.append((prompt, reply, stop, _stored_row(target, prompt, reply)))
    assert len(out) >= 2, "too few replies with a token to stand in for the end of sequence"
    return out


def test_prompt_lookup_chain_counts_the_stop_token_as_online(
    replies_ending_at_a_stop: list, target: torch.nn.Module
) -> None:
    """A reply that ended at the end of sequence: the store holds it without that token, and
    online decoding (`dflash evaluate --stop-at-eos`) writes it, keeps it and counts it. The
    chain offline gains the same tokens in the same steps, per response."""
    from evaluation.chained import prompt_lookup_chains

    for prompt, reply, stop, row in replies_ending_at_a_stop:
        generated, gains = prompt_lookup_online(target, prompt, 3, 64, frozenset([stop]))
        assert generated == [*reply, stop]
        offline = prompt_lookup_chains([row], 3, stop_ids=frozenset([stop]))
        assert offline == [(sum(gains), len(gains))]


def oracle_chains(
    target: torch.nn.Module,
    prompt: list[int],
    written: list[int],
    row: dict,
    block_size: int,
    stop_ids: frozenset[int],
    offline_stop_ids: frozenset[int] | None = None,
) -> tuple[list[tuple[int, int]], list[int]]:
    """(offline chained figure of `row`, online gains) of a drafter that always drafts the
    target's own tokens (`written` after `prompt`, then anything): online under `stop_ids`,
    offline under `offline_stop_ids` (default the same). The caller has made the offline
    block's predictions its labels (forward_batch and greedy_predictions patched)."""
    from types import SimpleNamespace

    from evaluation import chained

    truth = [*prompt, *written] + [0] * block_size

    def oracle(tokens: list[int], _f: torch.Tensor | None) -> list[int]:
        return truth[len(tokens) : len(tokens) + block_size - 1]

    _, gains, _ = speculative_generate(
        CachedTarget(target, None), prompt, oracle, 64, stop_ids=stop_ids
    )
    offline = chained.chained_acceptance(
        None,
        SimpleNamespace(lm_head_VD=None),
        [row],
        block_size=block_size,
        mask_token_id=0,
        backend="sdpa",
        chunk_tokens=64,
        device=torch.device("cpu"),
        stop_ids=stop_ids if offline_stop_ids is None else offline_stop_ids,
    )
    return offline, gains


def test_drafter_chain_counts_the_stop_token_as_online(
    replies_ending_at_a_stop: list, target: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for the drafter's chain, with a drafter that always drafts the target's tokens
    (the stop token, then anything, included): online it gains the reply and its stop token;
    offline the block slot at the stop token, one past what the store holds, must be labelled
    with it and count."""
    from evaluation import chained

    # the oracle offline: the block's predictions are its labels
    monkeypatch.setattr(chained, "forward_batch", lambda m, h, batch, **k: batch.labels_AB)
    monkeypatch.setattr(chained, "greedy_predictions", lambda hidden, head, chunk: hidden)
    for prompt, reply, stop, row in replies_ending_at_a_stop:
        offline, gains = oracle_chains(target, prompt, [*reply, stop], row, 4, frozenset([stop]))
        assert offline == [(sum(gains), len(gains))]
        assert sum(gains) == len(reply)  # every token after the first, the stop included


def test_stop_ids_only_for_stores_whose_replies_do_not_hold_them() -> None:
    """A {prompt, completion} or text store holds a reply without the end of sequence that
    ended it; a chat store holds the template's end-of-turn token as the reply's last loss
    token, which online decoding stops at: nothing to add there."""
    from evaluation.chained import unstored_stop_ids

    attrs = {"tokenizer": {"eos_token_id": 7}, "target": {"config": {"eos_token_id": [7, 9]}}}
    for fmt, expected in (("completion", {7, 9}), ("text", {7, 9}), ("messages", set())):
        assert unstored_stop_ids(attrs | {"dataset": {"format": fmt}}) == expected


def test_evaluate_offline_shows_its_progress(tmp_path: Path) -> None:
    """Each drafter forward of the chained pass advances every response by what it accepts:
    on a CPU 4 sequences took minutes, and the command said nothing until its JSON."""
    from click.testing import CliRunner
    from store_factory import build_store

    from dflash_offline.cli import main
    from stage2_train.export import export_drafter

    spec = FactorySpec(num_sequences=3)
    store = build_store(tmp_path / "store", spec)
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), target_config(spec), 2, spec.vocab_size, 3
    )
    torch.manual_seed(0)
    export = export_drafter(
        DFlashDrafter(shape), shape, spec.tapped_layers, target_config(spec), tmp_path / "export"
    )
    result = CliRunner().invoke(
        main, ["evaluate-offline", "--drafter", str(export), "--store", str(store)]
    )
    assert result.exit_code == 0, result.output
    assert "random anchors: 100%" in result.stderr and "3/3" in result.stderr
    assert "chained tau: 100%" in result.stderr
    assert re.search(r"batch [\d,]+/[\d,]+ tokens, pooled tau \d\.\d\d", result.stderr)
    assert json.loads(result.stdout)["chained_responses"] > 0
