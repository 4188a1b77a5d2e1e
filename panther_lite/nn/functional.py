"""The sketched-linear operator: ``y = scale · ((x·S1)·U1 + (x·U2)·S2) + b``.

It is a ``torch.library`` custom op with its own backward, so that

* the forward is two GEMMs of width ``2·L·k`` (``x·[S1 | U2]`` then ``·[U1; S2]``),
  never a per-term ``L × batch × out`` temporary;
* backward saves only ``x`` and the ``batch × 2Lk`` hidden activation, and skips the
  gradients of the fixed ``U`` buffers (autograd on the plain GEMM chain would compute
  them and throw half of them away);
* ``torch.compile(fullgraph=True)`` sees one opaque op (no graph break), and
  ``torch.export`` keeps it.

Autocast is applied by :func:`sketched_linear` before the op is called (custom ops are
not cast by autocast on their own), so every autocast dtype works and the casts are
recorded by autograd: fp32 master parameters receive fp32 gradients.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["sketched_linear"]


def _stacked(S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor) -> Tuple[Tensor, Tensor]:
    """``[S1 | U2]`` (in × 2Lk) and ``[U1; S2]`` (2Lk × out)."""
    return torch.cat((S1, U2), dim=1), torch.cat((U1, S2), dim=0)


@torch.library.custom_op("panther_lite::sketched_linear", mutates_args=())
def _sketched_linear_op(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tuple[Tensor, Tensor]:
    left, right = _stacked(S1, U1, U2, S2)
    hidden = x @ left
    if bias is None:
        out = torch.mm(hidden, right).mul_(scale)
    else:
        out = torch.addmm(bias, hidden, right, alpha=scale)
    return out, hidden


@_sketched_linear_op.register_fake
def _(x, S1, U1, U2, S2, bias, scale):
    out = x.new_empty(x.shape[0], U1.shape[1])
    hidden = x.new_empty(x.shape[0], 2 * S1.shape[1])
    return out, hidden


def _setup_context(ctx, inputs, output):
    x, S1, U1, U2, S2, bias, scale = inputs
    _, hidden = output
    ctx.scale = scale
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # the hidden output is internal: no zero-filled gradient for it
    ctx.save_for_backward(x, hidden, S1, U1, U2, S2)


def _backward(ctx, grad_out: Tensor, grad_hidden: Optional[Tensor]):
    x, hidden, S1, U1, U2, S2 = ctx.saved_tensors
    rank = S1.shape[1]
    if grad_out is None:
        grad_out = torch.zeros(x.shape[0], U1.shape[1], dtype=x.dtype, device=x.device)
    g = grad_out * ctx.scale
    need_x, need_S1, need_S2 = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4]
    grad_x = grad_S1 = grad_S2 = grad_bias = None
    if need_x or need_S1:
        left, right = _stacked(S1, U1, U2, S2)
        grad_hidden_total = g @ right.t()
        if grad_hidden is not None:
            grad_hidden_total = grad_hidden_total + grad_hidden
        if need_x:
            grad_x = grad_hidden_total @ left.t()
        if need_S1:
            grad_S1 = x.t() @ grad_hidden_total[:, :rank]
    if need_S2:
        grad_S2 = hidden[:, rank:].t() @ g
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias = grad_out.sum(0)
    return grad_x, grad_S1, None, None, grad_S2, grad_bias, None


_sketched_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def sketched_linear(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], scale: float
) -> Tensor:
    """Apply a sketched linear map to ``x`` of shape ``(*, in)``; returns ``(*, out)``.

    Args:
        x: input ``(*, in)``; any number of leading dims, or 1-D ``(in,)``.
        S1: ``(in, R)`` with ``R = L·k``, the concatenated trainable left factors.
        U1: ``(R, out)`` fixed sketch.
        U2: ``(in, R)`` fixed sketch.
        S2: ``(R, out)`` trainable right factors.
        bias: ``(out,)`` or None.
        scale: ``1 / (2L)``.

    Under autocast the floating inputs are cast to the autocast dtype (as ``F.linear``
    is); otherwise all tensors must share one dtype.
    """
    cast_dtype = _autocast_dtype(x.device.type)
    if cast_dtype is not None:
        x, S1, U1, U2, S2 = (t.to(cast_dtype) for t in (x, S1, U1, U2, S2))
        bias = None if bias is None else bias.to(cast_dtype)
    if x.dim() == 2:
        return _sketched_linear_op(x, S1, U1, U2, S2, bias, scale)[0]
    out, _ = _sketched_linear_op(x.reshape(-1, x.shape[-1]), S1, U1, U2, S2, bias, scale)
    return out.reshape(*x.shape[:-1], out.shape[-1])
