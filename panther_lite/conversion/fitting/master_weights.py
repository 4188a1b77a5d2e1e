"""Float32 master weights: a half-precision module held in float32 while it trains, then rounded back.

Adam's moments and updates smaller than half a unit in the last place of a bfloat16 value
(2⁻⁸ relative) are lost in half precision; held in float32 for the duration of the training
(the "master weights" of mixed-precision training, Micikevicius et al. 2018), they accumulate
until they show, and float16 gradients cannot underflow. Block-wise refinement
(:mod:`.block_refinement`) and distillation
(:mod:`~panther_lite.conversion.distilling.distillation`) both train this way. Memory: 2 more
bytes per half-precision element of the module for the duration.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

__all__ = ["HALF_DTYPES", "in_float32", "widened"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def in_float32(module: nn.Module) -> Iterator[bool]:
    """``module``'s float16/bfloat16 parameters and buffers held in float32 for the duration
    (the same tensors, their ``.data`` widened), then rounded back, also on error; yields
    whether any was (a module left unchanged is restored bit for bit)."""
    low = [t for t in itertools.chain(module.parameters(), module.buffers()) if t.dtype in HALF_DTYPES]
    dtypes = [t.dtype for t in low]
    for tensor in low:
        tensor.data = tensor.data.float()
    try:
        yield bool(low)
    finally:
        for tensor, dtype in zip(low, dtypes):
            tensor.data = tensor.data.to(dtype)


def widened(value):
    """``value`` (a tensor or a nest of tuples, lists and dicts of them) with its float16/bfloat16
    tensors in float32, the inputs of a module held :func:`in_float32`."""
    widen = lambda leaf: leaf.float() if isinstance(leaf, torch.Tensor) and leaf.dtype in HALF_DTYPES else leaf
    return tree_map(widen, value)
