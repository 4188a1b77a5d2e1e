"""A key/value cache for decoding a known number of tokens: transformers' ``DynamicCache`` whose
full-attention layers write each step into buffers allocated once, where the plain one makes a
grown copy of every layer's keys and values at every step.

Those copies cost more than their bytes: each is a fresh allocation a little larger than the one
it replaces, so the heap fragments. Sampling 86 sequences of 256 tokens from SmolLM2-135M (float32,
its outputs kept) peaked at 4.56 GB resident with the plain cache and at 2.30 GB with this one.
"""
from __future__ import annotations

import functools
from typing import Optional

from torch import Tensor, nn

__all__ = ["preallocated_cache"]


@functools.lru_cache(maxsize=None)
def _preallocated_layer() -> type:
    """The layer class, made on first use so that importing this module needs no transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` holding ``capacity`` tokens in buffers allocated at its first update
        (doubled if ever outgrown); its ``keys`` and ``values`` are views of the filled part.
        Made for a decoding loop: what reorders or crops a cache in place (beam search) is not kept."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity, self.length, self.buffers = capacity, 0, ()

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if not self.buffers or end > self.buffers[0].shape[-2]:
                self.buffers = self._grown((key_states, value_states), max(end, self.capacity, 2 * self.length))
            for buffer, states in zip(self.buffers, (key_states, value_states)):
                buffer[:, :, self.length:end] = states
            self.length = end
            self.keys, self.values = (buffer[:, :, :end] for buffer in self.buffers)
            return self.keys, self.values

        def _grown(self, states, size: int):
            """New buffers of ``size`` tokens shaped like ``states``, holding what is filled so far."""
            grown = tuple(part.new_empty(part.shape[:-2] + (size, part.shape[-1])) for part in states)
            for new, old in zip(grown, self.buffers):
                new[:, :, :self.length] = old[:, :, :self.length]
            return grown

    return PreallocatedLayer


def preallocated_cache(model: nn.Module, capacity: int) -> Optional[object]:
    """A ``DynamicCache`` for ``model`` (a transformers causal LM) whose plain full-attention layers
    allocate ``capacity`` tokens once, to pass as the cache of its first call; None where
    transformers or the model offers no such cache (the model then makes its own). Layers of
    other kinds (sliding windows, linear attention) stay as the model's config makes them.

    Example:
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                   num_hidden_layers=2, num_attention_heads=2)
        >>> cache = preallocated_cache(transformers.LlamaForCausalLM(config), capacity=12)
        >>> keys, values = cache.layers[0].update(torch.ones(1, 2, 5, 8), torch.ones(1, 2, 5, 8))
        >>> tuple(keys.shape), tuple(cache.layers[0].buffers[0].shape)  # 5 tokens filled of 12
        ((1, 2, 5, 8), (1, 2, 12, 8))
    """
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return None
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    config = getattr(model, "config", None)
    if config is None or supports is None or not supports():
        return None
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not any(type(layer) is DynamicLayer for layer in layers):
        return None
    made = _preallocated_layer()
    cache.layers = [made(capacity) if type(layer) is DynamicLayer else layer for layer in layers]
    return cache
