"""Chat rows to token ids and assistant loss masks, through the tokenizer's own chat template.

The drafter learns to predict what the target writes as the assistant, so the loss mask marks
each assistant turn: its content plus the template's end-of-turn token(s) that close it (the
target must learn to stop), never the role header, and not the whitespace the template puts
after the end token (e.g. the newline after ChatML's `<|im_end|>`), which belongs to the
layout between turns.

Most real chat templates have no `{% generation %}` tags, so the mask is found from the text:
the conversation is rendered once, and for assistant message i the span of its turn runs from
the end of `render(messages[:i], add_generation_prompt=True)` to the end (trailing whitespace
removed) of `render(messages[:i+1])`. That holds when both renders are prefixes of the full text.
Templates that rewrite history (Qwen3 drops earlier turns' `<think>` blocks and adds an empty
one to the last turn) break it for some turns; such a turn is found by search instead: after the
text of the messages before it, past the next generation prompt; it ends after its content plus
the end-of-turn text (learned by rendering a sentinel as the content), or, when the template
changed the content, at the next end-of-turn text.
Character spans become token masks through the fast
tokenizer's offsets on the full text: a token is a loss token when it overlaps a span.
Templates with `{% generation %}` tags use transformers' own `return_assistant_tokens_mask`.

A turn the target did not end with the template's end of turn (a `dflash generate` reply cut
at its token limit, or ended by another stop token such as its `<|endoftext|>`; the row's
`wrote_end_of_turn`, one boolean per assistant message) trains on its content alone: the
end-of-turn text the template writes after it gets no loss (the target would have gone on
writing, or wrote another token there), in all three ways of finding the turns.

An assistant turn with empty content stays in the conversation (the turns around it still
train) but has no loss tokens: there is nothing of the target's to predict in it, and its
end-of-turn token alone would teach the drafter to stop right after a header. A conversation
whose assistant turns are all empty is an InvalidRow ("empty_assistant"). A turn with
`tool_calls` is not empty: the calls as the template writes them (e.g. Qwen3's
`<tool_call>` JSON) are what the target writes in that turn, so they train, from the end of the
generation prompt through the end-of-turn text.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

# ShareGPT and other datasets name the speakers in many ways; chat templates expect these three
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "system": "system",
}
GENERATION_TAG_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# stands for an assistant's content when probing a template for its end-of-turn text
SENTINEL = "\u2063dflash-sentinel\u2063"
# the row field (chat rows; `dflash generate` writes it) with one boolean per assistant message,
# in order: false where the target did not write the template's end of turn after the reply
WROTE_END_OF_TURN = "wrote_end_of_turn"


class InvalidRow(Exception):
    """A row that cannot become a training document; `reason` is the key counted when skipping."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail

    def refusal(self, where: str, index: int) -> ValueError:
        """The error when rows are not skipped: the data, the row, what is wrong, the fix."""
        return ValueError(
            f"data {where} row {index}: {self.detail}; fix or remove the row, or pass "
            "--set data.on_invalid=skip to skip such rows"
        )


def normalize_conversation(
    raw: Any, fmt: str, empty_replies_ok: bool = False
) -> list[dict[str, Any]]:
    """A row's `messages` ([{role, content}]) or ShareGPT `conversations` ([{from, value}]) as
    chat-template messages; raises InvalidRow for rows that cannot train the drafter.
    `empty_replies_ok`: every assistant turn will be rewritten (`dflash generate`), so empty ones
    are placeholders, not rows without loss."""
    if not raw:
        raise InvalidRow("empty_conversation", "the conversation has no messages")
    messages = [template_message(item, j, fmt) for j, item in enumerate(raw)]
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        raise InvalidRow("no_assistant", "the conversation has no assistant message")
    if not empty_replies_ok and all(is_empty_turn(m) for m in assistants):
        raise InvalidRow("empty_assistant", "every assistant message has empty content")
    return messages


def template_message(item: Any, j: int, fmt: str) -> dict[str, Any]:
    """Message j of a conversation ({role, content}, or ShareGPT's {from, value}) as a chat
    template takes it: roles named as templates name them, content a string (OpenAI's list of
    text parts joined), the Nones Arrow fills in for other rows' keys dropped; InvalidRow when
    it cannot be one."""
    role_key, content_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    if not isinstance(item, dict) or item.get(role_key) is None:
        raise InvalidRow(
            "bad_message",
            f"message {j} has no '{role_key}' (expected {{{role_key}, {content_key}}})",
        )
    role = str(item[role_key])
    if fmt == "sharegpt" and role.lower() not in ROLE_ALIASES:
        raise InvalidRow(
            "unknown_role", f"message {j} is from {role!r}; known: {sorted(ROLE_ALIASES)}"
        )
    content = item.get(content_key)
    if isinstance(content, list):
        content = text_of_parts(content, j)
    if content is not None and not isinstance(content, str):
        raise InvalidRow("bad_message", f"message {j} content is not a string: {content!r:.80}")
    # keep extra fields (tool_calls, reasoning_content...) for the template, but not the Nones
    # that Arrow fills in for keys other rows have: templates test `is defined`, not truthiness
    extra = {} if fmt == "sharegpt" else item
    message = {k: v for k, v in extra.items() if v is not None and k not in ("role", "content")}
    message["role"] = ROLE_ALIASES.get(role.lower(), role)
    message["content"] = content or ""
    return message


def text_of_parts(parts: list[Any], j: int) -> str:
    """OpenAI's content as a list of parts ([{type: "text", text}]) as the one string chat
    templates render: the texts joined by newlines, as vLLM and TensorRT-LLM join them for a
    template that takes strings (what the target sees when such a request is served). A part
    of another type (an image) has no text the drafter could learn from: an InvalidRow."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRow(
                "non_text_content",
                f"message {j} content has a part that is not text ({kind!r}, expected "
                f"{{type: 'text', text: ...}}): {part!r:.80}",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def is_empty_turn(message: dict[str, Any]) -> bool:
    """An assistant message with nothing to learn: no loss tokens for it. A turn of tool calls
    alone is not empty: the template writes the calls, and they are the target's text."""
    return (
        message["role"] == "assistant"
        and not message["content"].strip()
        and not message.get("tool_calls")
    )


def has_generation_tags(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(GENERATION_TAG_RE.search(template))


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    gen: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str | None:
    """The template's text, or None when it refuses this partial conversation (many templates
    raise on, e.g., a conversation that does not start with a user turn)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, **(template_kwargs or {})
        )
    except Exception:
        return None


def _locate_turn(
    full: str, content: str, header: str, closing: str, after: int, calls: bool = False
) -> tuple[int, int] | None:
    """Span of an assistant turn found by search from `after`: it starts after the next
    `header` (the generation prompt) or, without one, at the content; it ends after the content
    as given plus `closing`, or, when the template rewrote the content or writes tool calls
    after it (`calls`), at the next `closing`."""
    if calls and not content.strip():
        # the calls' text is the template's own rendering: found between header and closing
        at = full.find(header, after) if header else -1
        stop = full.find(closing, at + len(header)) if at >= 0 and closing else -1
        return (at + len(header), stop + len(closing)) if stop >= 0 else None
    texts = list(dict.fromkeys((content, content.strip())))
    found = [i for i in (full.find(t, after) for t in texts) if i >= 0]
    at = full.find(header, after) if header else -1
    # the header only where it comes before the content: a header that a later turn alone
    # renders (Qwen3's empty think block with enable_thinking false, only on the last turn)
    # found first would place this turn at that one
    if at >= 0 and (not found or at <= min(found)):
        start = at + len(header)
    else:
        if not found:
            return None
        start = min(found)
    if not calls:  # (calls follow the content: the turn ends at the next closing)
        for text in texts:
            if full.startswith(text, start):
                end = start + len(text)
                return start, end + len(closing) if closing and full.startswith(
                    closing, end
                ) else end
    stop = full.find(closing, start) if closing else -1
    return (start, stop + len(closing)) if stop >= 0 else None


def _closing_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    i: int,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The end-of-turn text the template writes after assistant message i (e.g. `<|im_end|>`),
    learned from a turn whose content the template cannot rewrite; empty when it writes none or
    refuses the probe."""
    message = messages[i]
    probe = _render(
        tokenizer,
        # without its calls: the closing is what follows a turn's text, not the calls
        [
            *messages[:i],
            {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": SENTINEL},
        ],
        gen=False,
        template_kwargs=template_kwargs,
    )
    if probe is None or SENTINEL not in probe:
        return ""
    return probe[probe.index(SENTINEL) + len(SENTINEL) :].rstrip()


def _without_closing(full: str, span: tuple[int, int], closing: str) -> tuple[int, int]:
    """`span` without the end-of-turn text `closing` that ends it (a turn the target did not
    end: that text is the template's, not the target's)."""
    start, end = span
    if closing and end - len(closing) >= start and full.startswith(closing, end - len(closing)):
        return start, end - len(closing)
    return span


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    full: str,
    template_kwargs: dict[str, Any] | None = None,
    unended: frozenset[int] = frozenset(),
) -> list[tuple[int, int]]:
    """[start, end) character spans in `full` (the rendered conversation) of each assistant
    turn: content plus the end-of-turn text, without the header or trailing whitespace; for
    the messages in `unended` (turns the target did not end), without the end-of-turn text."""
    kw = template_kwargs
    spans: list[tuple[int, int]] = []
    after = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], gen=True, template_kwargs=kw)
        turn = _render(tokenizer, messages[: i + 1], gen=False, template_kwargs=kw)
        if is_empty_turn(message):  # no span; the next turn is searched for after it
            if turn is not None and full.startswith(turn):
                after = max(after, len(turn.rstrip()))
            continue
        if head is not None and turn is not None:
            end = len(turn.rstrip())
            if full.startswith(turn) and turn.startswith(head) and after <= len(head) < end:
                span = (len(head), end)
                if i in unended:
                    span = _without_closing(full, span, _closing_text(tokenizer, messages, i, kw))
                spans.append(span)
                after = end
                continue
        # fallback: the template renders this turn differently once later turns follow it
        before = _render(tokenizer, messages[:i], gen=False, template_kwargs=kw)
        if before is not None and full.startswith(before):
            after = max(after, len(before))
        else:  # past the text of the messages since the previous assistant turn, so that
            # the search cannot find this reply inside the question before it (templates that
            # render a system prompt into the last user turn only, as Mistral's)
            j = i - 1
            while j >= 0 and messages[j]["role"] != "assistant":
                j -= 1
            for other in messages[j + 1 : i]:
                at = full.find(other["content"], after) if other["content"] else -1
                if at >= 0:
                    after = at + len(other["content"])
        header = (
            head[len(before) :] if head and before is not None and head.startswith(before) else ""
        )
        closing = _closing_text(tokenizer, messages, i, kw)
        calls = bool(message.get("tool_calls"))
        span = _locate_turn(full, message["content"], header, closing, after, calls)
        if span is None:
            raise InvalidRow(
                "template_mismatch",
                f"assistant message {i} was not found in the rendered chat template text",
            )
        after = span[1]
        spans.append(_without_closing(full, span, closing) if i in unended else span)
    return spans


def _turn_token_range(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    i: int,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """Token range of assistant turn i (after its generation prompt, through its end), from the
    lengths of the tokenized renders before and through it."""

    def length(part: list[dict[str, Any]], gen: bool) -> int:
        enc = tokenizer.apply_chat_template(
            part,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=gen,
            **(template_kwargs or {}),
        )
        return len(enc["input_ids"])

    return (length(messages[:i], True) if i else 0), length(messages[: i + 1], False)


def spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [T] mask of the tokens (char offsets [T, 2]) that overlap any span."""
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return mask.astype(np.uint8)


def _unmask_closing(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    i: int,
    ids: list[int],
    mask: list[int],
    template_kwargs: dict[str, Any],
) -> None:
    """No loss on the end-of-turn tokens of assistant message i in `mask` (a template's
    `{% generation %}` mask): the last run of the closing's ids inside the turn's tokens."""
    closing = _closing_text(tokenizer, messages, i, template_kwargs)
    closing_ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    if not closing_ids:
        return
    start, end = _turn_token_range(tokenizer, messages, i, template_kwargs)
    for at in range(min(end, len(ids)) - len(closing_ids), start - 1, -1):
        if ids[at : at + len(closing_ids)] == closing_ids:
            mask[at : at + len(closing_ids)] = [0] * len(closing_ids)
            return


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict[str, Any]]],
    template_kwargs: dict[str, Any] | None = None,
    unended: list[frozenset[int]] | None = None,
) -> list[tuple[list[int], list[int]] | InvalidRow]:
    """(input_ids, loss_mask) of each normalised conversation, or the InvalidRow it raised.
    `template_kwargs` go to every render (e.g. {"enable_thinking": False} for Qwen3).
    `unended`: per conversation, the assistant messages the target did not end (no loss on the
    end-of-turn text the template writes after them)."""
    kw = template_kwargs or {}
    results: list[Any] = [None] * len(conversations)
    unended = unended or [frozenset()] * len(conversations)
    if has_generation_tags(tokenizer):
        for k, messages in enumerate(conversations):
            try:
                enc = tokenizer.apply_chat_template(
                    messages,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                    **kw,
                )
            except Exception as err:  # the template's own raise_exception, or a Jinja error
                results[k] = InvalidRow("template_error", f"the chat template failed: {err}")
                continue
            ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
            for i, message in enumerate(messages):
                if is_empty_turn(message):
                    start, end = _turn_token_range(tokenizer, messages, i, kw)
                    mask[start:end] = [0] * len(mask[start:end])
                elif i in unended[k]:
                    _unmask_closing(tokenizer, messages, i, ids, mask, kw)
            results[k] = (ids, mask)
        return results

    texts: dict[int, str] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    for k, messages in enumerate(conversations):
        full = _render(tokenizer, messages, gen=False, template_kwargs=kw)
        if full is None:
            results[k] = InvalidRow("template_error", "the chat template refused this conversation")
            continue
        try:
            spans[k] = assistant_char_spans(tokenizer, messages, full, kw, unended[k])
        except InvalidRow as err:
            results[k] = err
            continue
        texts[k] = full
    if texts:
        # the template writes any BOS itself, as apply_chat_template(tokenize=True) assumes
        enc = tokenizer(list(texts.values()), add_special_tokens=False, return_offsets_mapping=True)
        for k, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"], strict=True):
            mask = spans_to_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans[k])
            results[k] = (list(ids), mask.tolist())
    return results
