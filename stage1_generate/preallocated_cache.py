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


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers of `capacity` positions; `keys`
    and `values` are views of the filled part, as `DynamicLayer` would hold them."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.filled = 0
        self._keys_BKCD: torch.Tensor | None = None
        self._values_BKCD: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        end = self.filled + new
        if self._keys_BKCD is None or end > self._keys_BKCD.shape[-2]:
            # first call, or more positions than planned (a caller that generates past the
            # length it gave): grow once, geometrically, keeping what is filled
            self._grow(key_states, value_states, max(end, self.capacity, 2 * self.filled))
        assert self._keys_BKCD is not None and self._values_BKCD is not None
        self._keys_BKCD[:, :, self.filled : end] = key_states
        self._values_BKCD[:, :, self.filled : end] = value_states
        self.filled = end
        # the attributes DynamicLayer's other methods read (length, device, dtype)
        self.keys = self._keys_BKCD[:, :, :end]
        self.values = self._values_BKCD[:, :, :end]
        self.is_initialized = True
        self.device, self.dtype = key_states.device, key_states.dtype
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self._keys_BKCD is not None and self._values_BKCD is not None and self.filled:
            keys[:, :, : self.filled] = self._keys_BKCD[:, :, : self.filled]
            values[:, :, : self.filled] = self._values_BKCD[:, :, : self.filled]
        self._keys_BKCD, self._values_BKCD = keys, values


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
