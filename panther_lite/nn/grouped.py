"""The grouped sketched-linear operator: rows sorted by expert, each expert's rows through its own factors.

``panther_lite::grouped_sketched_linear`` is :func:`~panther_lite.nn.functional.sketched_linear`
for a stack of ``E`` sketched linear maps (one per expert of a mixture of experts): rows
``bounds[e]:bounds[e + 1]`` of ``x`` (the rows routed to expert ``e``, contiguous after a
sort by expert) go through ``S1[e]``, ``U1[e]``, ``U2[e]``, ``S2[e]`` with the same
stacked schedule and backward as SKLinear (:func:`~panther_lite.nn.functional.stacked_rows_forward`,
:func:`~panther_lite.nn.functional.stacked_rows_backward`: two GEMMs of width ``2Lk`` per
expert, written straight into the output rows; the factors are concatenated once per
call, for all experts). It is the sketched counterpart of
transformers' ``grouped_mm`` experts path: one host synchronisation per call (the group
bounds are read once), no per-row copy of any weight, experts that receive no rows cost
nothing, and gradients are computed only for the trainable ``S1``, ``S2`` and the bias.

Forward and backward are both opaque ``torch.library`` ops (the backward loop is its own
op), so ``torch.compile(fullgraph=True)`` traces the experts forward and its autograd
without entering the data-dependent loop over groups.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .functional import stacked_rows_backward, stacked_rows_forward

__all__ = ["expert_groups", "grouped_rows", "grouped_sketched_linear"]


def expert_groups(expert_ids: Tensor, num_experts: int) -> Tuple[Tensor, Tensor]:
    """Sort routed entries by expert: ``(order, bounds)``.

    ``expert_ids`` is 1-D; ``order`` the stable permutation that sorts it; ``bounds``
    ``(num_experts + 1,)`` the group edges: expert ``e`` owns sorted rows
    ``bounds[e]:bounds[e + 1]``. Entries outside ``[0, num_experts)`` fall before
    ``bounds[0]`` or after ``bounds[-1]`` (the op rejects them). Fixed output sizes, so
    ``torch.compile`` traces it without graph breaks.
    """
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    edges = torch.arange(num_experts + 1, device=expert_ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, edges)


def _group_edges(bounds: Tensor, rows: int) -> List[int]:
    """``bounds`` as a list (the one host synchronisation), checked to cover all ``rows``."""
    edges = bounds.tolist()
    outside = edges[0] + rows - edges[-1]
    if outside:
        raise ValueError(
            f"top_k_index must hold expert indices in [0, num_experts={len(edges) - 1}); "
            f"{outside} of the {rows} routed entries are outside"
        )
    return edges


def grouped_rows(
    x: Tensor, left: Tensor, right: Tensor, bias: Optional[Tensor], bounds: Tensor, scale: float
) -> Tuple[Tensor, Tensor]:
    """The grouped product from stacked factors ``left = [S1 | U2]`` ``(E, in, 2R)`` and
    ``right = [U1; S2]`` ``(E, 2R, out)``: ``(out, hidden)`` with ``hidden = x·left[e]`` and
    ``out = scale·hidden·right[e] + bias[e]`` on expert ``e``'s rows, written in place (no
    autograd: the op below records it; no-grad calls use it directly with cached factors)."""
    edges = _group_edges(bounds, x.shape[0])
    out = x.new_empty(x.shape[0], right.shape[-1])
    hidden = x.new_empty(x.shape[0], left.shape[-1])
    for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        if end > start:
            b = None if bias is None else bias[e]
            stacked_rows_forward(x[start:end], left[e], right[e], b, scale, out[start:end], hidden[start:end])
    return out, hidden


@torch.library.custom_op("panther_lite::grouped_sketched_linear", mutates_args=())
def _grouped_op(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], bounds: Tensor, scale: float
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, hidden, left, right)``: the stacked factors are outputs too, so the backward
    reuses them instead of concatenating the factors again."""
    left, right = torch.cat((S1, U2), dim=-1), torch.cat((U1, S2), dim=-2)
    out, hidden = grouped_rows(x, left, right, bias, bounds, scale)
    return out, hidden, left, right


@_grouped_op.register_fake
def _(x, S1, U1, U2, S2, bias, bounds, scale):
    left = S1.new_empty(*S1.shape[:-1], 2 * S1.shape[-1])
    right = S2.new_empty(S2.shape[0], 2 * S2.shape[1], S2.shape[-1])
    return x.new_empty(x.shape[0], S2.shape[-1]), x.new_empty(x.shape[0], left.shape[-1]), left, right


@torch.library.custom_op("panther_lite::grouped_sketched_linear_backward", mutates_args=())
def _grouped_backward_op(
    grad_out: Tensor,
    x: Tensor,
    hidden: Tensor,
    left: Tensor,
    right: Tensor,
    bounds: Tensor,
    scale: float,
    needs: List[bool],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(x, S1, S2, bias)``; an unneeded one is an empty tensor. Experts that
    received no rows get zero gradients."""
    edges = _group_edges(bounds, x.shape[0])
    need_x, need_S1, need_S2, need_bias = needs
    experts, rank = left.shape[0], left.shape[-1] // 2
    grad_x = x.new_empty(x.shape) if need_x else x.new_empty(0)
    grads = [
        left.new_empty(experts, left.shape[1], rank) if need_S1 else None,
        right.new_empty(experts, rank, right.shape[-1]) if need_S2 else None,
        right.new_empty(experts, right.shape[-1]) if need_bias else None,
    ]
    for e, (start, end) in enumerate(zip(edges[:-1], edges[1:])):
        rows = slice(start, end)
        expert_grads = (None,) * 3
        if end > start:
            _, *expert_grads = stacked_rows_backward(
                grad_out[rows], x[rows], hidden[rows, rank:], left[e], right[e], scale, tuple(needs),
                grad_x[rows] if need_x else None,
            )  # fmt: skip
        for stack, value in zip(grads, expert_grads):
            if stack is not None:
                stack[e].zero_() if value is None else stack[e].copy_(value)
    grad_S1, grad_S2, grad_bias = (x.new_empty(0) if g is None else g for g in grads)
    return grad_x, grad_S1, grad_S2, grad_bias


@_grouped_backward_op.register_fake
def _(grad_out, x, hidden, left, right, bounds, scale, needs):
    need_x, need_S1, need_S2, need_bias = needs
    experts, rank = left.shape[0], left.shape[-1] // 2
    return (
        torch.empty_like(x) if need_x else x.new_empty(0),
        left.new_empty(experts, left.shape[1], rank) if need_S1 else x.new_empty(0),
        right.new_empty(experts, rank, right.shape[-1]) if need_S2 else x.new_empty(0),
        right.new_empty(experts, right.shape[-1]) if need_bias else x.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    x, S1, U1, U2, S2, bias, bounds, scale = inputs
    ctx.scale = scale
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)
    _, hidden, left, right = output
    ctx.save_for_backward(x, hidden, left, right, bounds)


def _backward(ctx, grad_out: Optional[Tensor], *_internal_grads: Optional[Tensor]):
    need = ctx.needs_input_grad
    needs = [need[0], need[1], need[4], ctx.has_bias and need[5]]
    if grad_out is None or not any(needs):
        return None, None, None, None, None, None, None, None
    x, hidden, left, right, bounds = ctx.saved_tensors
    grads = _grouped_backward_op(grad_out, x, hidden, left, right, bounds, ctx.scale, needs)
    grad_x, grad_S1, grad_S2, grad_bias = (g if n else None for g, n in zip(grads, needs))
    return grad_x, grad_S1, None, None, grad_S2, grad_bias, None, None


_grouped_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_sketched_linear(
    x: Tensor, S1: Tensor, U1: Tensor, U2: Tensor, S2: Tensor, bias: Optional[Tensor], bounds: Tensor, scale: float
) -> Tensor:
    """Apply expert ``e``'s sketched linear map to rows ``bounds[e]:bounds[e + 1]`` of ``x``.

    Args:
        x: ``(rows, in)``, sorted by expert (see :func:`expert_groups`).
        S1, U2: ``(E, in, R)`` with ``R = L·k``; ``U1``, ``S2``: ``(E, R, out)``.
        bias: ``(E, out)`` or None.
        bounds: ``(E + 1,)`` integer group edges, ``bounds[0] == 0`` and
            ``bounds[-1] == rows`` (ValueError naming ``top_k_index`` otherwise).
        scale: ``1 / (2L)``.

    Returns ``(rows, out)``. The operands must already share the input's dtype and device
    (the caller applies autocast's casts; a custom op is not cast by autocast).
    """
    return _grouped_op(x, S1, U1, U2, S2, bias, bounds, scale)[0]
