"""A chat reply the target did not end: no loss on the end of turn the template writes after it.

`dflash generate` rewrites each assistant turn; a reply cut at `sampling.max_new_tokens` (or
ended by a stop token other than the template's end of turn, e.g. `<|endoftext|>` where ChatML
closes with `<|im_end|>`) is followed, once extract renders the row through the chat template,
by an end of turn the target never wrote there. Trained on it, the drafter learns to stop where
the target goes on. Generate now records per row which turns the target ended
(`wrote_end_of_turn`), and extract leaves the others' end of turn without loss, in each way it
finds the turns: prefix renders, the search, and `{% generation %}` tags. Expected masks are
built by tokenizing hand-written pieces, each wholly loss or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from common.generated import manifest_path, read_manifest
from stage1_extract import chat
from stage1_extract.store_root import content_key
from stage1_generate.inputs import TURN_ENDS
from stage1_generate.local_backend import Completion
from stage1_generate.rows import generate_chat
from stage1_generate.run import run_generate
from tests.test_data import (
    CHATML_GENERATION_TEMPLATE,
    THINK_TEMPLATE,
    chatml_tokenizer,
    expected_from_pieces,
    prepare,
)
from tests.test_generate import config, read_rows, write_jsonl
from tests.test_generate_reply_specials import (
    CHAT,
    LENGTHS,
    SCRIPT,
    extracted,
    ids,
    scripted,  # noqa: F401 (the fixture)
)

CONVERSATION = [
    {"role": "user", "content": "What is a prime number?"},
    {"role": "assistant", "content": "A number whose only divisors are"},  # cut
    {"role": "user", "content": "Is two prime?"},
    {"role": "assistant", "content": "Yes, two is the only even prime."},
]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def chatml_pieces(messages, ended, rendered=None) -> list[tuple[str, int]]:
    """ChatML pieces with loss on each assistant turn's content, and on its `<|im_end|>` only
    where `ended` (one per assistant turn) says the target wrote it. `rendered`: the content
    as the template writes it, by message index, where it rewrites it."""
    pieces, turn = [], 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            content = (rendered or {}).get(i, m["content"])
            pieces += [("<|im_start|>assistant\n", 0), (content, 1)]
            pieces += [("<|im_end|>", int(ended[turn])), ("\n", 0)]
            turn += 1
        else:
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0))
    return pieces


@pytest.mark.parametrize("ended", [[False, True], [True, False], [False, False], [True, True]])
def test_prefix_renders_leave_a_cut_turns_end_without_loss(tmp_path: Path, ended) -> None:
    tok = chatml_tokenizer()
    rows = [{"messages": CONVERSATION, "wrote_end_of_turn": ended}]
    prepared = prepare(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert prepared.skipped == {}
    (row,) = prepared.dataset
    expected = expected_from_pieces(tok, chatml_pieces(CONVERSATION, ended))
    assert (row["input_ids"], row["loss_mask"]) == expected
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [m for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if t == end]
    assert ends[1::2] == [int(e) for e in ended]  # (the user turns' ends: never loss)


def test_rows_without_the_field_train_every_end_as_before(tmp_path: Path) -> None:
    """Data of other sources, and generate folders of earlier versions: every end trains."""
    tok = chatml_tokenizer()
    prepared = prepare(write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}]), tok)
    (row,) = prepared.dataset
    expected = expected_from_pieces(tok, chatml_pieces(CONVERSATION, [True, True]))
    assert (row["input_ids"], row["loss_mask"]) == expected


@pytest.mark.parametrize("think", [True, False])
@pytest.mark.parametrize("ended", [[False, True], [True, False]])
def test_the_search_leaves_a_cut_turns_end_without_loss(think: bool, ended) -> None:
    """Turn 1 is rendered otherwise once a later turn follows (the search finds it: its content
    rewritten with think, as given without), turn 3 by prefix renders."""
    tok = chatml_tokenizer()
    tok.chat_template = THINK_TEMPLATE
    first = "<think>\nshort\n</think>\n\nYes, it" if think else "Yes, it"
    messages = [
        {"role": "user", "content": "Yes, it?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\nSure."},
    ]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert not full.startswith(tok.apply_chat_template(messages[:2], tokenize=False))
    unended = frozenset(i for i, e in zip((1, 3), ended, strict=True) if not e)
    [result] = chat.tokenize_conversations(tok, [messages], None, [unended])
    pieces = chatml_pieces(messages, ended, {1: "Yes, it"})
    assert result == expected_from_pieces(tok, pieces)


@pytest.mark.parametrize("ended", [[False, True], [True, False]])
def test_generation_tags_leave_a_cut_turns_end_without_loss(ended) -> None:
    tok = chatml_tokenizer()
    tok.chat_template = CHATML_GENERATION_TEMPLATE
    assert chat.has_generation_tags(tok)
    unended = frozenset(i for i, e in zip((1, 3), ended, strict=True) if not e)
    [result] = chat.tokenize_conversations(tok, [CONVERSATION], None, [unended])
    assert result == expected_from_pieces(tok, chatml_pieces(CONVERSATION, ended))


@pytest.mark.parametrize("value", [[True], [True, True, False]], ids=["short", "long"])
def test_a_field_that_does_not_match_the_turns_is_an_invalid_row(tmp_path: Path, value) -> None:
    tok = chatml_tokenizer()
    rows = [
        {"messages": CONVERSATION, "wrote_end_of_turn": value},
        {"messages": CONVERSATION, "wrote_end_of_turn": None},  # none recorded: all ended
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare(path, tok, on_invalid="skip")
    assert prepared.skipped == {"bad_turn_ends": 1}
    (row,) = prepared.dataset
    expected = expected_from_pieces(tok, chatml_pieces(CONVERSATION, [True, True]))
    assert (row["input_ids"], row["loss_mask"]) == expected
    with pytest.raises(ValueError, match=r"row 0: 'wrote_end_of_turn' must hold one true/false"):
        prepare(path, tok)


class ScriptedEnds:
    """A backend whose r-th reply of each round is `replies[r]`: (text, finished, stop id)."""

    max_positions, max_positions_source = None, "none"

    def __init__(self, tokenizer, replies: list[tuple[str, bool, int | None]]) -> None:
        self.tokenizer, self.replies, self.round = tokenizer, replies, 0

    def generate(self, prompts, max_new_tokens, on_batch=None, stop=True):  # noqa: ANN001, ANN201
        text, finished, stop_id = self.replies[self.round]
        self.round += 1
        reply = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [Completion(text, len(reply), finished, reply, stop_id) for _ in prompts]


def test_generate_records_which_turns_the_target_ended(tiny_qwen3: Path, tmp_path: Path) -> None:
    """Ended by the template's end of turn (or a stop the server did not name): recorded as
    ended, its end trained; cut at the limit, or ended by another stop (<|endoftext|>): not,
    its end left without loss; the reply's own tokens train either way."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Last"},
        {"role": "assistant", "content": ""},
    ]
    replies = [(" one", True, end), (" two", False, None), (" three", True, endoftext)]
    replies.append((" four", True, None))
    cfg = config(tiny_qwen3, tmp_path / "unused.jsonl", tmp_path / "out")
    result = generate_chat(
        [messages], [0], "messages", cfg, tokenizer, ScriptedEnds(tokenizer, replies)
    )
    (row,) = result.rows
    assert row["wrote_end_of_turn"] == [True, False, False, True]
    assert row["truncated_turns"] == 1
    prepared = prepare(write_jsonl(tmp_path / "gen.jsonl", result.rows), tokenizer)
    (doc,) = prepared.dataset
    pieces = chatml_pieces(row["messages"], [True, False, False, True])
    expected = expected_from_pieces(tokenizer, pieces)
    assert (doc["input_ids"], doc["loss_mask"]) == expected


def test_a_cut_reply_end_to_end(scripted: Path, tmp_path: Path) -> None:  # noqa: F811
    """The scripted target writes SCRIPT then <|im_end|> after every chat prompt: with room for
    it every turn ends and its end trains; one token short, every turn is cut, its reply trains
    and its end does not."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    script, end = ids(tokenizer, SCRIPT), tokenizer.convert_tokens_to_ids("<|im_end|>")
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT])
    for cut in (False, True):
        out = tmp_path / f"out-{cut}"
        lengths = [*LENGTHS, f"sampling.max_new_tokens={len(script) - 1}"] if cut else LENGTHS
        manifest = run_generate(config(scripted, source, out, *lengths))
        assert manifest["content"][TURN_ENDS] == "recorded"
        assert manifest["counts"]["truncated"] == (3 if cut else 0)
        rows = read_rows(out)
        assert [r["wrote_end_of_turn"] for r in rows] == [[not cut], [not cut, not cut]]
        reply = script[:-1] if cut else script
        for input_ids, mask in extracted(scripted, out, tmp_path / f"x-{cut}"):
            learned = [t for t, m in zip(input_ids, mask, strict=True) if m]
            turns = input_ids.count(end) // 2  # each turn's end, and its question's
            assert learned == (reply + ([] if cut else [end])) * turns
            assert [m for t, m in zip(input_ids, mask, strict=True) if t == end][1::2] == [
                int(not cut)
            ] * turns


def _as_version_before(out: Path, complete: bool) -> None:
    """`out` as a version before TURN_ENDS wrote it: no marker, no field in its rows."""
    import gzip

    manifest = read_manifest(out)
    manifest["content"].pop(TURN_ENDS)
    manifest.update(key=content_key(manifest["content"]), complete=complete)
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    for path in out.glob("part-*.jsonl.gz"):
        rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
        lines = "".join(
            json.dumps({k: v for k, v in r.items() if k != "wrote_end_of_turn"}) + "\n"
            for r in rows
        )
        path.write_bytes(gzip.compress(lines.encode(), mtime=0))


def test_a_folder_of_an_earlier_version_reads_as_before_and_is_not_resumed(
    scripted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A finished one reruns as a no-op and extract trains its ends as before (nothing says
    which were cut); an unfinished one is refused, naming what it left out (the chunks of both
    versions would mix); --overwrite regenerates it."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    script, end = ids(tokenizer, SCRIPT), tokenizer.convert_tokens_to_ids("<|im_end|>")
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT])
    out = tmp_path / "out"
    cfg = config(scripted, source, out, *LENGTHS, f"sampling.max_new_tokens={len(script) - 1}")
    run_generate(cfg)
    _as_version_before(out, complete=True)
    before = read_rows(out)
    again = run_generate(cfg)
    assert TURN_ENDS not in again["content"] and read_rows(out) == before
    for input_ids, mask in extracted(scripted, out, tmp_path / "x-old"):
        learned = [t for t, m in zip(input_ids, mask, strict=True) if m]
        assert learned == (script[:-1] + [end]) * (input_ids.count(end) // 2)
    manifest = read_manifest(out)
    manifest["complete"] = False
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    (out / ".dflash-generate" / "chunk-000001.json").unlink()
    with pytest.raises(ValueError, match=r"older dflash-offline.*chat replies.*--overwrite"):
        run_generate(cfg)
    cfg.output.overwrite = True
    assert run_generate(cfg)["content"][TURN_ENDS] == "recorded"
    assert all(r["wrote_end_of_turn"] for r in read_rows(out))
