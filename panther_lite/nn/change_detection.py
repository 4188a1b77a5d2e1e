"""When a cached function of parameters is stale: version counters, storage, and optimizer steps.

A tensor's version counter moves on every in-place write through it (``copy_``, ``mul_``
under ``no_grad``, ``load_state_dict``, foreach optimizers) but not on writes through
``.data`` and not on PyTorch's *fused* optimizers (``Adam(fused=True)`` and friends update
parameters without bumping it). The signature below therefore also counts optimizer steps:
every ``torch.optim.Optimizer.step`` (fused or not) makes every earlier signature stale.
What remains invisible is a write through ``.data`` outside an optimizer.
"""
from __future__ import annotations

from typing import Iterable

from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["tensor_signature"]

_steps_seen = 0


def _count_step(optimizer, args, kwargs) -> None:
    global _steps_seen
    _steps_seen += 1


register_optimizer_step_post_hook(_count_step)


def tensor_signature(tensors: Iterable[Tensor]) -> tuple:
    """A value equal to an earlier one only if none of ``tensors`` can have changed since:
    the same storage, shape, strides, dtype, device and version counter, and no optimizer
    step in between. Inference tensors have no version counter: do not cache them."""
    return (_steps_seen,) + tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tensors)
