"""Chained offline acceptance on a store that holds the stop token: `dflash generate` writes the
stop's text after a text or completion reply the target ended (since 915ef22), so extract stores
it with loss, as the reply's last token. The chain must gain what online decoding gains (the
reply and its stop, counted once), as it does on a store without the stop (tests/test_chained.py):
a run ending in a stop token is not extended past it."""

from __future__ import annotations

import pytest
import torch

from evaluation import chained
from tests.test_chained import (  # noqa: F401 (the fixtures)
    _stored_row,
    oracle_chains,
    prompt_lookup_online,
    replies_ending_at_a_stop,
    target,
)


def _row_with_its_stop(model: torch.nn.Module, prompt: list[int], reply: list[int], stop: int):
    """What extract stores of such a row now: the reply, then its stop, loss on both."""
    row = _stored_row(model, prompt, [*reply, stop])
    assert row["loss_mask"][-1] == 1 and int(row["tokens"][-1]) == stop
    return row


def test_prompt_lookup_chain_counts_a_stored_stop_once(
    replies_ending_at_a_stop: list,  # noqa: F811
    target: torch.nn.Module,  # noqa: F811
) -> None:
    for prompt, reply, stop, _ in replies_ending_at_a_stop:
        generated, gains = prompt_lookup_online(target, prompt, 3, 64, frozenset([stop]))
        assert generated == [*reply, stop]
        row = _row_with_its_stop(target, prompt, reply, stop)
        stops = chained.stops_after(row["tokens"], row["target_argmax"], frozenset([stop]))
        runs = chained.response_runs(row["loss_mask"], row["document_ids"], stops)
        assert runs.tolist() == [[len(prompt), len(prompt) + len(reply) + 1]]  # not extended
        offline = chained.prompt_lookup_chains([row], 3, stop_ids=frozenset([stop]))
        assert offline == [(sum(gains), len(gains))]


def test_drafter_chain_counts_a_stored_stop_once(
    replies_ending_at_a_stop: list,  # noqa: F811
    target: torch.nn.Module,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chained, "forward_batch", lambda m, h, batch, **k: batch.labels_AB)
    monkeypatch.setattr(chained, "greedy_predictions", lambda hidden, head, chunk: hidden)
    for prompt, reply, stop, _ in replies_ending_at_a_stop:
        row = _row_with_its_stop(target, prompt, reply, stop)
        offline, gains = oracle_chains(target, prompt, [*reply, stop], row, 4, frozenset([stop]))
        assert offline == [(sum(gains), len(gains))]
