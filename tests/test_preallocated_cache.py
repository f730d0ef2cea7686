"""run.kv_cache=preallocated: transformers' dynamic cache with layers written in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

from common.logging import get_logger
from stage1_generate import gqa_decode, local_backend
from stage1_generate.config import SamplingConfig
from stage1_generate.local_backend import LocalBackend
from stage1_generate.preallocated_cache import PreallocatedLayer, cache_kwargs
from stage1_generate.rows import stop_token_ids


def test_layer_holds_what_concatenation_holds() -> None:
    """Prefill, decode steps and steps past the planned capacity (it grows, keeping what is
    filled) leave the same keys and values as DynamicLayer's concatenation; the prefill is
    kept as given (no buffer while its temporaries live), the decode steps are views of one
    buffer while within capacity."""
    gen = torch.Generator().manual_seed(0)
    ours, reference = PreallocatedLayer(capacity=7), DynamicLayer()
    assert ours.get_seq_length() == 0
    storages = []
    for new in (5, 1, 1, 1, 1, 3):  # 5 + 2 fit the capacity of 7, then it grows
        key = torch.randn(2, 3, new, 4, generator=gen)
        value = torch.randn(2, 3, new, 4, generator=gen)
        got_k, got_v = ours.update(key, value)
        want_k, want_v = reference.update(key, value)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert ours.get_seq_length() == reference.get_seq_length()
        storages.append(got_k.untyped_storage().data_ptr())
    # steps 6-7 fill the planned buffer of 7 without a copy; step 8 grows it once, to 14
    assert storages[1] == storages[2] != storages[3] == storages[4] == storages[5]
    assert ours._keys_BKCD is not None and ours._keys_BKCD.shape[-2] == 14
    assert ours.filled == 12 and ours.keys.shape[-2] == 12


def test_layer_refuses_what_would_rewrite_it() -> None:
    """Beam search's reordering, assisted decoding's crop, batch selection and resets would
    leave the buffers stale: they refuse instead of changing replies silently."""
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    for method, args in (
        ("crop", (-1,)),
        ("reset", ()),
        ("reorder_cache", (torch.tensor([0]),)),
        ("batch_select_indices", (torch.tensor([0]),)),
        ("batch_repeat_interleave", (2,)),
    ):
        with pytest.raises(NotImplementedError, match="run.kv_cache=dynamic"):
            getattr(layer, method)(*args)


def test_backend_refuses_targets_it_cannot_serve(tiny_qwen3: Path) -> None:
    """A sliding-window target needs transformers' own cache types: a clear refusal."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    stops = stop_token_ids(tokenizer, None, {})
    LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, "preallocated")
    model.config.layer_types = ["sliding_attention"] + model.config.layer_types[1:]
    with pytest.raises(ValueError, match="not all full attention.*run.kv_cache=dynamic"):
        LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, "preallocated")


def test_auto_takes_the_preallocated_cache_where_the_target_allows(
    tiny_qwen3: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """run.kv_cache=auto (the default) runs the preallocated cache on a full-attention target
    and the dynamic one, with a log line that says why, where the target cannot take it (a
    sliding-window layer, a cache named by the checkpoint): no refusal, no silent change."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    stops = stop_token_ids(tokenizer, None, {})
    assert LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20).preallocated
    for kv in ("dynamic", "static"):
        backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, kv)
        assert not backend.preallocated and backend.kv_cache == kv
    model.generation_config.cache_implementation = "hybrid"
    with caplog.at_level("INFO", logger=get_logger().name):
        backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, "auto")
    assert backend.kv_cache == "dynamic" and not backend.preallocated
    assert "run.kv_cache=auto: the dynamic KV cache" in caplog.text and "'hybrid'" in caplog.text
    model.generation_config.cache_implementation = None
    model.config.layer_types = ["sliding_attention"] + model.config.layer_types[1:]
    backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, "auto")
    assert backend.kv_cache == "dynamic"


@pytest.mark.parametrize("attn", ["sdpa", gqa_decode.GQA_DECODE])
def test_backend_replies_match_the_dynamic_cache(
    tiny_qwen3: Path, attn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left-padded prompts of several lengths through the backend: the same replies as with
    transformers' dynamic cache, with every layer a PreallocatedLayer of the batch's final
    length (so no per-step concatenation ran)."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen3, dtype=torch.float32, attn_implementation=attn
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    stops = stop_token_ids(tokenizer, None, {})
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (9, 4, 13, 7)]
    caches = []

    def spy(model: torch.nn.Module, capacity: int) -> dict:
        kwargs = cache_kwargs(model, capacity)
        caches.append((capacity, next(iter(kwargs.values()))))
        return kwargs

    monkeypatch.setattr(local_backend, "cache_kwargs", spy)
    replies = {}
    for kv in ("dynamic", "preallocated"):
        backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 4, 1 << 20, kv)
        replies[kv] = [c.token_ids for c in backend.generate(prompts, 6)]
    assert replies["preallocated"] == replies["dynamic"]
    assert [capacity for capacity, _ in caches] == [13 + 6]  # one batch: widest prompt + new
    layers = caches[0][1].layers
    assert len(layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, PreallocatedLayer) and layer.capacity == 19 for layer in layers)
