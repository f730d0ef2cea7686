"""`run.kv_cache=preallocated`: transformers' dynamic KV cache without its per-step copy.

Why: transformers' `DynamicLayer.update` appends each decode step's key and value with
`torch.cat`, which copies the whole cache of every layer at every step: a 4,096-row batch of
the pystd recipe moves ~2x its cache through memory per step for one new token (the seventh
session's profile put `cat` at 9% of the GPU time before the GQA decode removed the largest
costs). Here each layer's cache is allocated once per batch at its final length (prompt
width + new tokens, known before the first step), the new rows are written in place, and
attention reads a view of the filled part: the same keys and values in the same order, so the
same replies (tests/test_generate.py), without the copy. Unlike `static`, nothing is compiled
and attention never reads the unfilled tail.

The cache is transformers' own `DynamicCache` with this module's layer class, so everything
that inspects a dynamic cache (its length, masks, generate's bookkeeping) sees one.

Legend: B batch rows, K key/value heads, L filled length, C capacity, D head dim.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from common.target_config import text_config


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values, once decoding starts, live in buffers of
    `capacity` positions; `keys` and `values` are views of the filled part, as `DynamicLayer`
    would hold them.

    The prefill's keys and values are kept as given (as `DynamicLayer` keeps them): the buffer
    is allocated at the first one-token step, when the prefill's temporaries are gone, so the
    peak memory stays the dynamic cache's (its full cache plus one layer's copy). Greedy and
    sampled generation only: the methods that rewrite a cache (beam search's reordering,
    assisted generation's cropping, batch selection, offloading) refuse."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0
        self._keys_BKCD: torch.Tensor | None = None
        self._values_BKCD: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True
        new = key_states.shape[-2]
        end = self.filled + new
        if self.filled == 0 and new > 1:  # the prefill: kept as it is, no buffer yet
            self.keys, self.values, self.filled = key_states, value_states, end
            return self.keys, self.values
        if self._keys_BKCD is None or end > self._keys_BKCD.shape[-2]:
            # the first decode step, or more positions than planned (a caller that generates
            # past the length it gave): a buffer holding what is filled, grown geometrically
            grown = self.capacity if self._keys_BKCD is None else 2 * self._keys_BKCD.shape[-2]
            self._allocate(key_states, value_states, max(end, grown))
        assert self._keys_BKCD is not None and self._values_BKCD is not None
        self._keys_BKCD[:, :, self.filled : end] = key_states
        self._values_BKCD[:, :, self.filled : end] = value_states
        self.filled = end
        # the attributes DynamicLayer's other methods read (the length)
        self.keys = self._keys_BKCD[:, :, :end]
        self.values = self._values_BKCD[:, :, :end]
        return self.keys, self.values

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, size: int) -> None:
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_empty(batch, heads, size, dim)
        values = value_states.new_empty(batch, heads, size, value_states.shape[-1])
        if self.filled:  # the prefill's tensors or the smaller buffer's views
            keys[:, :, : self.filled] = self.keys
            values[:, :, : self.filled] = self.values
        self._keys_BKCD, self._values_BKCD = keys, values

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "run.kv_cache=preallocated serves greedy and sampled generation only (no beam "
            "search, assisted decoding or cache offloading); use run.kv_cache=dynamic"
        )

    crop = reset = reorder_cache = batch_select_indices = batch_repeat_interleave = _refuse
    offload = prefetch = _refuse


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take a preallocated cache, or None: every layer must be full
    attention (a sliding-window or linear-attention layer needs its own cache type, which
    transformers builds from the config), and the checkpoint must not name its own cache."""
    config = text_config(model.config)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are not all full attention ({', '.join(sorted(kinds))})"
    # older configs say sliding windows without layer_types (Mistral; Qwen2's switch)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"it attends through a sliding window of {config.sliding_window} tokens"
    named = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if named:
        return f"its generation_config names the cache {named!r}"
    return None


def preallocated_cache(capacity: int) -> DynamicCache:
    """An empty `DynamicCache` whose layers (created as the model reaches them) preallocate
    `capacity` positions each."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(PreallocatedLayer, capacity)
    return cache


@functools.cache
def _cache_argument(forward: Any) -> str:
    params = inspect.signature(forward).parameters
    # transformers renamed past_key_values to cache (5.2x); the device image has the old name
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, capacity: int) -> dict[str, DynamicCache]:
    """`generate` keyword arguments that hand `model` a preallocated cache of `capacity`
    positions, under the cache argument's name in the installed transformers."""
    return {_cache_argument(type(model).forward): preallocated_cache(capacity)}
