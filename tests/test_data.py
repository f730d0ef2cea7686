"""Data loading and loss masks; expected masks are built by tokenizing hand-written pieces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pytest
from tokenizers import processors

from common.tiny import EXAMPLE_DATA, build_tokenizer, example_texts
from stage1_extract import chat
from stage1_extract.config import DataConfig
from stage1_extract.data import prepare_documents

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# transformers renders with trim_blocks (a newline right after a block tag is dropped): hence '\\n'
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{{ '\\n' }}{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# like Qwen3: earlier assistant turns lose their <think> block once a later turn follows, and
# the last assistant turn gets an empty one when it has none
THINK_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% elif message['role'] == 'assistant' and '</think>' not in content %}"
    "{% set content = '<think>\\n\\n</think>\\n\\n' + content %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is a prime number?"},
    {"role": "assistant", "content": "A number whose only divisors are one and itself."},
    {"role": "user", "content": "Is two prime?"},
    {"role": "assistant", "content": "Yes, two is the only even prime."},
]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def chatml_tokenizer():
    return build_tokenizer(example_texts())


def llama3_tokenizer():
    tok = build_tokenizer(example_texts())
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    tok.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def expected_from_pieces(tok, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Token ids and mask of text pieces tokenized one by one, each wholly loss or not."""
    ids: list[int] = []
    mask: list[int] = []
    for text, loss in pieces:
        piece_ids = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        mask += [loss] * len(piece_ids)
    return ids, mask


def chatml_pieces(messages, assistant_text=lambda i, m: m["content"]) -> list[tuple[str, int]]:
    pieces = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            pieces += [("<|im_start|>assistant\n", 0), (assistant_text(i, m), 1)]
            pieces += [("<|im_end|>", 1), ("\n", 0)]
        else:
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0))
    return pieces


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(path: Path, tok=None, **kw):
    return prepare_documents(DataConfig(path=str(path), **kw), tok or chatml_tokenizer())


def test_chatml_mask_multi_turn_with_system(tmp_path):
    tok = chatml_tokenizer()
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]
    prepared = prepare(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert prepared.format == "messages" and prepared.num_rows == 2 and prepared.skipped == {}
    assert prepared.dataset.column_names == ["input_ids", "loss_mask", "source_index"]
    for row, messages in zip(prepared.dataset, (CONVERSATION, CONVERSATION[1:3]), strict=True):
        ids, mask = expected_from_pieces(tok, chatml_pieces(messages))
        assert row["input_ids"] == ids
        assert row["loss_mask"] == mask
    assert prepared.dataset["source_index"][:] == [0, 1]
    # the end-of-turn token is trained, the newline after it is not
    last = prepared.dataset[0]
    assert tok.convert_ids_to_tokens(last["input_ids"][-2:]) == ["<|im_end|>", "Ċ"]
    assert last["loss_mask"][-2:] == [1, 0]


def test_llama3_template_mask():
    tok = llama3_tokenizer()
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["content"] = "  A number whose only divisors are one and itself.\n"  # trimmed
    [(ids, mask)] = chat.tokenize_conversations(tok, [messages])
    pieces = [("<|begin_of_text|>", 0)]
    for m in messages:
        header = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
        if m["role"] == "assistant":
            pieces += [(header, 0), (m["content"].strip(), 1), ("<|eot_id|>", 1)]
        else:
            pieces.append((header + m["content"] + "<|eot_id|>", 0))
    assert (ids, mask) == expected_from_pieces(tok, pieces)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")


def test_generation_tags_path_equals_offsets_path(monkeypatch):
    tok = chatml_tokenizer()
    tok.chat_template = CHATML_GENERATION_TEMPLATE
    assert chat.has_generation_tags(tok)
    [tagged] = chat.tokenize_conversations(tok, [CONVERSATION])
    monkeypatch.setattr(chat, "has_generation_tags", lambda tokenizer: False)
    [offsets] = chat.tokenize_conversations(tok, [CONVERSATION])
    assert tagged == offsets == expected_from_pieces(tok, chatml_pieces(CONVERSATION))


@pytest.mark.parametrize("think", [True, False])
def test_template_rewriting_history_falls_back_to_search(think):
    tok = chatml_tokenizer()
    tok.chat_template = THINK_TEMPLATE
    first = "<think>\nshort\n</think>\n\nYes?" if think else "Yes?"
    messages = [
        {"role": "user", "content": "Yes?"},  # same text as the answer: must not be matched
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\nSure."},
    ]
    full = tok.apply_chat_template(messages, tokenize=False)
    first_turn = tok.apply_chat_template(messages[:2], tokenize=False)
    assert not full.startswith(first_turn)  # the prefix property fails for turn 1
    [(ids, mask)] = chat.tokenize_conversations(tok, [messages])
    # turn 1 as rendered in history (think stripped), the last turn in full
    rendered = {1: "Yes?", 3: messages[3]["content"]}
    pieces = chatml_pieces(messages, lambda i, m: rendered[i])
    assert (ids, mask) == expected_from_pieces(tok, pieces)

    # a last turn without a <think> block: the empty block the template adds is trained too
    messages[3]["content"] = "Sure."
    [(ids, mask)] = chat.tokenize_conversations(tok, [messages])
    rendered[3] = "<think>\n\n</think>\n\nSure."
    assert (ids, mask) == expected_from_pieces(
        tok, chatml_pieces(messages, lambda i, m: rendered[i])
    )


def test_an_empty_think_block_in_the_generation_prompt_keeps_each_turn_in_place():
    """Qwen3 with enable_thinking false: the generation prompt ends in an empty think block that
    history renders on the last assistant turn only. Turn 1 (rendered otherwise once a later
    turn follows) must not be searched for at the last turn's header."""
    tok = chatml_tokenizer()
    tok.chat_template = THINK_TEMPLATE.replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}",
    )
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ]
    kwargs = {"enable_thinking": False}
    [result] = chat.tokenize_conversations(tok, [messages], kwargs)
    assert not isinstance(result, chat.InvalidRow), result
    pieces = chatml_pieces(messages[:2]) + [
        ("<|im_start|>user\nTell a joke<|im_end|>\n", 0),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", 0),  # the generation prompt's
        (messages[3]["content"], 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    assert result == expected_from_pieces(tok, pieces)


def test_a_reply_quoted_in_its_question_is_found_after_the_question():
    """A template that renders the system prompt into the last user turn only (Mistral's): the
    prefix property fails, and the reply "Paris" must be found after the question that
    contains it, not inside it."""
    tok = chatml_tokenizer()
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
        "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}"
        "{% endif %}{% for m in rest %}{% if m['role'] == 'user' %}[INST] "
        "{% if loop.last and sys %}{{ sys }}\n\n{% endif %}{{ m['content'] }}[/INST]"
        "{% else %} {{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Is the capital of France Paris or Lyon?"},
        {"role": "assistant", "content": "Paris"},
    ]
    [result] = chat.tokenize_conversations(tok, [messages])
    assert not isinstance(result, chat.InvalidRow), result
    pieces = [("[INST] Is the capital of France Paris or Lyon?[/INST] ", 0)]
    pieces += [("Paris", 1), ("<|im_end|>", 1)]
    assert result == expected_from_pieces(tok, pieces)


def test_sharegpt_roles_are_mapped(tmp_path):
    tok = chatml_tokenizer()
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in CONVERSATION]
    sharegpt[-1]["from"] = "chatgpt"
    prepared = prepare(write_jsonl(tmp_path / "s.jsonl", [{"conversations": sharegpt}]), tok)
    assert prepared.format == "sharegpt"
    row = prepared.dataset[0]
    assert (row["input_ids"], row["loss_mask"]) == expected_from_pieces(
        tok, chatml_pieces(CONVERSATION)
    )


def test_plain_text_is_all_loss(tmp_path):
    tok = chatml_tokenizer()
    texts = ["Rain on the roof.", "A prime number has two divisors."]
    prepared = prepare(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), tok)
    assert prepared.format == "text"
    for row, text in zip(prepared.dataset, texts, strict=True):
        assert row["input_ids"] == tok(text)["input_ids"]
        assert row["loss_mask"] == [1] * len(row["input_ids"])
    rows = [{"text": texts[0]}, {"text": ""}, {"text": "  "}, {"text": texts[1]}]
    prepared = prepare(write_jsonl(tmp_path / "e.jsonl", rows), tok, on_invalid="skip")
    assert prepared.skipped == {"empty_text": 2}
    assert prepared.dataset["source_index"][:] == [0, 3]


def test_text_rows_match_a_plain_tokenizer_call(tmp_path):
    """Text rows skip the character offsets of a plain call when it adds nothing to the Rust
    tokenizer (data._text_ids), and fall back to the plain call otherwise: the ids must be the
    plain call's either way, for special tokens written in the text, non-ASCII text and long
    rows, with batches of several rows."""
    texts = [
        "def f(x):\n    return x  # ok\n",
        "na\u00efve caf\u00e9 \U0001f642 \u2014 \u6771\u4eac",
        "<|im_end|> written inside the text<|im_start|>",
        "\t\n spaces  ",
        "while True: pass\n" * 200,
    ]
    split = chatml_tokenizer()
    split.split_special_tokens = True  # the plain call then splits special tokens' text
    truncating = chatml_tokenizer()
    truncating.backend_tokenizer.enable_truncation(8)  # set on the backend: the plain call
    bos = llama3_tokenizer()  # a BOS before every text, as Llama's post-processor adds
    bos_id = bos.convert_tokens_to_ids("<|begin_of_text|>")
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
    )
    tokenizers = {
        "plain": chatml_tokenizer(),
        "bos": bos,
        "split": split,
        "truncating": truncating,
    }
    for name, tok in tokenizers.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in texts * 60])
        prepared = prepare(path, tok)
        expected = tok(texts * 60)["input_ids"]
        assert prepared.dataset["input_ids"][:] == expected, name
        assert prepared.dataset["loss_mask"][:] == [[1] * len(ids) for ids in expected], name
    assert tokenizers["split"](texts[2])["input_ids"] != tokenizers["plain"](texts[2])["input_ids"]
    assert bos(texts[0])["input_ids"][0] == bos_id
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": texts[0]}, {"text": " "}])
    with pytest.raises(ValueError, match="row 1: 'text' is empty or not a string"):
        prepare(path, chatml_tokenizer())


def test_an_empty_prompt_keeps_the_tokenizers_bos(tmp_path):
    """{prompt: "", completion: C} is run through the target as the text C would be: after the
    tokenizer's BOS (Llama), the loss on C."""
    bos = llama3_tokenizer()
    bos_id = bos.convert_tokens_to_ids("<|begin_of_text|>")
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
    )
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "", "completion": "Hello world"}])
    row = prepare(path, bos).dataset[0]
    assert row["input_ids"] == bos("Hello world")["input_ids"] and row["input_ids"][0] == bos_id
    assert row["loss_mask"] == [0] + [1] * (len(row["input_ids"]) - 1)


def test_explicit_fields(tmp_path):
    tok = chatml_tokenizer()
    path = write_jsonl(tmp_path / "f.jsonl", [{"dialog": CONVERSATION, "body": "Hello there."}])
    expected = expected_from_pieces(tok, chatml_pieces(CONVERSATION))[0]
    as_chat = prepare(path, tok, format="messages", messages_field="dialog")
    assert as_chat.dataset[0]["input_ids"] == expected
    assert prepare(path, tok, messages_field="dialog").format == "messages"  # auto
    as_text = prepare(path, tok, text_field="body")  # auto: only the text field is known
    assert as_text.format == "text"
    assert as_text.dataset[0]["input_ids"] == tok("Hello there.")["input_ids"]
    with pytest.raises(ValueError, match="columns"):  # an asked-for field must exist
        prepare(path, tok, messages_field="chat", text_field="body")


def test_auto_format_follows_message_fields(tmp_path):
    tok = chatml_tokenizer()
    expected = expected_from_pieces(tok, chatml_pieces(CONVERSATION))[0]
    # a "conversations" column of {role, content}, as many hub datasets have
    path = write_jsonl(tmp_path / "rc.jsonl", [{"conversations": CONVERSATION}])
    prepared = prepare(path, tok)
    assert prepared.format == "messages" and prepared.dataset[0]["input_ids"] == expected
    # ShareGPT messages under another column name
    sharegpt = [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]
    path = write_jsonl(tmp_path / "sg.jsonl", [{"dialog": sharegpt}])
    prepared = prepare(path, tok, messages_field="dialog")
    assert prepared.format == "sharegpt" and prepared.dataset[0]["input_ids"] == expected


def test_unknown_columns_error(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": "hi", "answer": "hello"}])
    with pytest.raises(ValueError) as err:
        prepare(path)
    msg = str(err.value)
    for needle in (str(path), "prompt", "answer", "messages", "conversations", "data.format"):
        assert needle in msg
    with pytest.raises(ValueError, match="data.messages_field"):
        prepare(path, format="sharegpt")


def test_missing_file_and_unreachable_hub(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        prepare(missing)
    with pytest.raises(ValueError, match="no-such-org/no-such-dataset.*neither a local"):
        prepare(Path("no-such-org/no-such-dataset"))


BAD_ROWS = {
    "empty_conversation": {"messages": []},
    "no_assistant": {"messages": [{"role": "user", "content": "Hello?"}]},
    "empty_assistant": {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]
    },
}


@pytest.mark.parametrize("reason", sorted(BAD_ROWS))
def test_invalid_row_error_names_file_and_row(tmp_path, reason):
    good = {"messages": CONVERSATION[1:3]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, BAD_ROWS[reason], good])
    with pytest.raises(ValueError) as err:
        prepare(path)
    assert f"{path} row 1" in str(err.value)
    assert "data.on_invalid=skip" in str(err.value)


def test_invalid_rows_skipped_and_counted(tmp_path):
    good = {"messages": CONVERSATION[1:3]}
    rows = [BAD_ROWS["no_assistant"], good, BAD_ROWS["empty_conversation"], good]
    rows += [BAD_ROWS["no_assistant"], good]
    prepared = prepare(write_jsonl(tmp_path / "mixed.jsonl", rows), on_invalid="skip")
    assert prepared.skipped == {"no_assistant": 2, "empty_conversation": 1}
    assert prepared.num_rows == 6
    assert prepared.dataset["source_index"][:] == [1, 3, 5]


def test_zero_loss_tokens_is_invalid(tmp_path):
    tok = chatml_tokenizer()
    # generation tags around nothing: the template trains on no token at all
    tok.chat_template = CHATML_GENERATION_TEMPLATE.replace(
        "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}",
        "{{ message['content'] }}<|im_end|>{% generation %}{% endgeneration %}",
    )
    path = write_jsonl(tmp_path / "z.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match="row 0: the row has no loss tokens"):
        prepare(path, tok)
    assert prepare(path, tok, on_invalid="skip").skipped == {"no_loss_tokens": 1}


def test_tokenizer_without_chat_template(tmp_path):
    tok = chatml_tokenizer()
    tok.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match="no chat_template.*target.tokenizer"):
        prepare(path, tok)


def test_folder_of_parquet_and_gzipped_jsonl(tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]
    reference = prepare(write_jsonl(tmp_path / "all.jsonl", rows)).dataset
    folder = tmp_path / "parquet"
    folder.mkdir()
    datasets.Dataset.from_list(rows[:2]).to_parquet(str(folder / "part-0.parquet"))
    datasets.Dataset.from_list(rows[2:]).to_parquet(str(folder / "part-1.parquet"))
    gz = tmp_path / "all.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for path in (folder, gz):
        got = prepare(path).dataset
        assert got["input_ids"][:] == reference["input_ids"][:]
        assert got["loss_mask"][:] == reference["loss_mask"][:]
        assert got["source_index"][:] == [0, 1, 2]


def test_max_samples(tmp_path):
    rows = [{"text": f"Row number {i}."} for i in range(5)]
    prepared = prepare(write_jsonl(tmp_path / "m.jsonl", rows), max_samples=3)
    assert prepared.num_rows == 3 and len(prepared.dataset) == 3


def test_tokenization_is_cached_by_fingerprint(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 3)
    first = prepare(path).dataset
    second = prepare(path).dataset  # a new tokenizer object with the same content
    assert first._fingerprint == second._fingerprint
    assert first.cache_files == second.cache_files


def test_example_data_is_valid():
    assert EXAMPLE_DATA.stat().st_size < 40_000
    rows = [json.loads(line) for line in EXAMPLE_DATA.read_text().splitlines()]
    assert len(rows) >= 35
    assert sum(r["messages"][0]["role"] == "system" for r in rows) >= 5
    assert sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows) >= 5
    prepared = prepare(EXAMPLE_DATA)
    assert prepared.num_rows == len(rows) and len(prepared.dataset) == len(rows)
    assert all(sum(mask) > 0 for mask in prepared.dataset["loss_mask"])


def test_parallel_tokenization_equals_serial_and_keeps_errors(tmp_path):
    good = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]
    path = write_jsonl(tmp_path / "many.jsonl", good * 20)
    serial = prepare(path).dataset
    parallel = prepare(path, num_proc=2).dataset
    assert parallel[:] == serial[:]
    bad = write_jsonl(tmp_path / "bad.jsonl", [*good * 5, BAD_ROWS["no_assistant"]])
    with pytest.raises(ValueError, match=f"{bad} row 10"):
        prepare(bad, num_proc=2)


def test_empty_assistant_turn_has_no_loss_and_the_rest_is_kept(tmp_path, monkeypatch):
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["content"] = " "
    tok = chatml_tokenizer()

    def text(i, m):  # the empty turn: its content and end token carry no loss
        return m["content"]

    pieces = chatml_pieces(messages, text)
    empty = pieces.index((" ", 1))
    pieces[empty], pieces[empty + 1] = (" ", 0), ("<|im_end|>", 0)
    expected = expected_from_pieces(tok, pieces)
    assert chat.tokenize_conversations(tok, [messages]) == [expected]
    tagged = chatml_tokenizer()
    tagged.chat_template = CHATML_GENERATION_TEMPLATE
    assert chat.tokenize_conversations(tagged, [messages]) == [expected]
    # kept under the default on_invalid=raise, counted with the skip reasons
    rows = [{"messages": messages}, {"messages": CONVERSATION[1:3]}]
    prepared = prepare(write_jsonl(tmp_path / "d.jsonl", rows), tok)
    assert prepared.skipped == {"empty_assistant_turn": 1}
    assert prepared.dataset["loss_mask"][0] == expected[1]
    # every assistant turn empty: no loss at all, so the row follows on_invalid
    all_empty = [{**m, "content": ""} if m["role"] == "assistant" else m for m in messages]
    path = write_jsonl(tmp_path / "e.jsonl", [rows[1], {"messages": all_empty}])
    with pytest.raises(ValueError, match="row 1: every assistant message has empty content"):
        prepare(path, tok)
    skipped = prepare(path, tok, on_invalid="skip")
    assert skipped.skipped == {"empty_assistant": 1} and skipped.dataset["source_index"][:] == [0]


def test_a_target_that_transforms_its_logits_is_named(caplog):
    """Granite scales, Cohere multiplies, Gemma 2 soft-caps the head's logits in its forward:
    extract says the store keeps them raw (FORMAT.md); a plain target says nothing."""
    from types import SimpleNamespace

    from common.logging import get_logger
    from stage1_extract.run import _warn_logit_transform

    log = get_logger()
    log.addHandler(caplog.handler)
    try:
        for config in ({"logits_scaling": 8.0}, {"text_config": {"final_logit_softcapping": 30}}):
            _warn_logit_transform(SimpleNamespace(attrs={"target": {"config": config}}))
        _warn_logit_transform(SimpleNamespace(attrs={"target": {"config": {"logit_scale": 1.0}}}))
    finally:
        log.removeHandler(caplog.handler)
    warned = list(dict.fromkeys(r.getMessage() for r in caplog.records))  # (root's copy too)
    assert len(warned) == 2, warned
    assert "logits_scaling=8.0" in warned[0] and "final_logit_softcapping=30" in warned[1]


# a ChatML template that writes an assistant turn's tool calls after its content (as Qwen3's
# writes <tool_call> JSON); LAST_TOOL_TEMPLATE marks the last message, so that every earlier
# turn renders otherwise once a later one follows (the search path)
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ MARK }}{{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
    "{{ c['function']['name'] }}({{ c['function']['arguments'] }})</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("mark_last", [False, True], ids=["prefix", "search"])
def test_tool_call_turns_train_on_the_calls(mark_last: bool) -> None:
    """An assistant turn of tool calls (empty content, or content then calls) is the target's
    text as the template writes it: trained through its end of turn, the tool's reply not; it
    was an empty turn before, without loss. Both paths: prefix renders, and the search."""
    tok = chatml_tokenizer()
    mark = "{{ 'LAST:' if loop.last else '' }}" if mark_last else ""
    tok.chat_template = TOOL_TEMPLATE.replace("{{ MARK }}", mark)
    call = {"type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "Add one."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "Calling again.", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "It is three."},
    ]
    assert not chat.is_empty_turn(messages[1])
    [(ids, mask)] = chat.tokenize_conversations(tok, [messages])
    calls = '<tool_call>add({"x": 1})</tool_call>'
    last = "LAST:" if mark_last else ""
    pieces = [
        ("<|im_start|>user\nAdd one.<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        (calls, 1),
        ("<|im_end|>", 1),
        ("\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Calling again." + calls, 1),
        ("<|im_end|>", 1),
        ("\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n", 0),
        (last + "It is three.", 1),  # the last turn's own text, as rendered last
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    assert (ids, mask) == expected_from_pieces(tok, pieces)
    # a conversation whose only assistant turn is a call is a row, not an empty one
    assert chat.normalize_conversation(messages[:2], "messages")[1]["tool_calls"] == [call]


def test_tool_calls_survive_a_jsonl_file(tmp_path: Path) -> None:
    """Through datasets (Arrow fills tool_calls=None on the messages without calls): the
    stored masks are tokenize_conversations' of the rows, the call turns trained."""
    tok = chatml_tokenizer()
    tok.chat_template = TOOL_TEMPLATE.replace("{{ MARK }}", "")
    call = {"type": "function", "function": {"name": "add", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "Add one."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "Two."},
    ]
    prepared = prepare(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}]), tok)
    assert prepared.skipped == {}  # no empty turn counted
    [(ids, mask)] = chat.tokenize_conversations(tok, [messages])
    assert prepared.dataset[0]["input_ids"] == ids and prepared.dataset[0]["loss_mask"] == mask
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained.startswith('<tool_call>add({"x": 1})</tool_call>')
