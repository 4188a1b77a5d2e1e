"""How SKExperts runs routed tokens through its experts: one schedule per transformers experts implementation.

Each schedule takes the experts module (an :class:`~panther_lite.nn.SKExperts`) and the
routing its model computed — ``hidden_states`` ``(T, hidden)``, ``top_k_index`` ``(T, K)``
expert ids, ``top_k_weights`` ``(T, K)`` — and returns ``Σ_k w[t, k] · expert_{id[t, k]}(x_t)``
``(T, hidden)`` in ``hidden_states``' dtype, with the same steps as transformers'
implementation of that name (``transformers.integrations.moe``), the dense products
replaced by sketched ones:

* ``grouped_mm`` — sort the ``T·K`` routed rows by expert, run each projection as one
  grouped op over contiguous groups (:func:`~panther_lite.nn.grouped.grouped_sketched_linear`),
  unsort and sum over ``K``. No copy of any weight; one host synchronisation per projection.
* ``batched_mm`` — gather each routed row's stacked factors and use two ``bmm`` per
  projection. Memory ``T·K·2Lk·(in + out)`` (the dense version gathers ``T·K·in·out``):
  for a few tokens (decoding), where it has no synchronisation and no loop.
* ``eager`` — a Python loop over the experts that received tokens, as transformers' eager
  forward (plain autograd; data-dependent, so ``torch.compile`` breaks the graph there).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor

from .functional import needs_grad
from .grouped import expert_groups, grouped_rows, grouped_sketched_linear

__all__ = ["SCHEDULES", "check_expert_ids"]


def check_expert_ids(top_k_index: Tensor, num_experts: int) -> None:
    """ValueError naming ``top_k_index`` unless every id is in ``[0, num_experts)``. Reads the
    ids on the host, so it is skipped while compiling (the grouped op checks its own)."""
    if torch.compiler.is_compiling() or top_k_index.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(top_k_index))
    if low < 0 or high >= num_experts:
        raise ValueError(
            f"top_k_index must hold expert indices in [0, num_experts={num_experts}), got values in [{low}, {high}]"
        )


def _combine(experts, rows: Tensor, weights: Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> Tensor:
    """Post-expert norm, routing weights, then the sum over each token's ``top_k`` rows."""
    weighted = experts.finish(rows) * weights.unsqueeze(-1)
    return weighted.view(tokens, top_k, weighted.shape[-1]).sum(dim=1).to(dtype)


def _grouped_projection(projection, rows: Tensor, bounds: Tensor) -> Tensor:
    """One projection on rows sorted by expert: the grouped op when autograd records it (or
    while compiling), else plain GEMMs with the cached stacked factors."""
    x, S1, U1, U2, S2, bias = projection.operands(rows)
    if torch.compiler.is_compiling() or needs_grad(x, S1, S2, bias):
        return grouped_sketched_linear(x, S1, U1, U2, S2, bias, bounds, projection.scale)
    x, left, right, bias = projection.stacked_operands(x)
    return grouped_rows(x, left, right, bias, bounds, 1.0)[0]


def grouped_experts(experts, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ``grouped_mm`` schedule (see the module docstring)."""
    tokens, top_k = top_k_index.shape
    order, bounds = expert_groups(top_k_index.reshape(-1), experts.num_experts)
    rows = hidden_states[order // top_k]
    for index, projection in enumerate(experts.projections()):
        if index:
            rows = experts.activate(rows)
        rows = _grouped_projection(projection, rows, bounds)
    unsorted = rows.new_empty(rows.shape).index_copy(0, order, rows)  # its backward is a gather
    return _combine(experts, unsorted, top_k_weights.reshape(-1), tokens, top_k, hidden_states.dtype)


def batched_experts(experts, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ``batched_mm`` schedule (see the module docstring)."""
    check_expert_ids(top_k_index, experts.num_experts)
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    rows = hidden_states.repeat_interleave(top_k, dim=0)
    for index, projection in enumerate(experts.projections()):
        if index:
            rows = experts.activate(rows)
        x, left, right, bias = projection.stacked_operands(rows)
        rows = torch.bmm(torch.bmm(x.unsqueeze(1), left[ids]), right[ids]).squeeze(1)
        if bias is not None:
            rows = rows + bias[ids]
    return _combine(experts, rows, top_k_weights.reshape(-1), tokens, top_k, hidden_states.dtype)


def _expert_product(x: Tensor, left: Tensor, right: Tensor, bias) -> Tensor:
    hidden = x @ left
    return hidden @ right if bias is None else torch.addmm(bias, hidden, right)


def eager_experts(experts, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ``eager`` schedule (see the module docstring)."""
    check_expert_ids(top_k_index, experts.num_experts)
    first, second = experts.projections()
    x, left1, right1, bias1 = first.stacked_operands(hidden_states)
    # an empty input in the dtype the first projection computes in gives the second one's operands
    _, left2, right2, bias2 = second.stacked_operands(x.new_empty(0, second.in_features))
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for (e,) in expert_hit:
        top_k_pos, token_idx = torch.where(expert_mask[e])
        h = _expert_product(x[token_idx], left1[e], right1[e], None if bias1 is None else bias1[e])
        h = _expert_product(experts.activate(h), left2[e], right2[e], None if bias2 is None else bias2[e])
        h = experts.finish(h) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))
    return final


SCHEDULES: Dict[str, Callable[..., Tensor]] = {
    "eager": eager_experts,
    "batched_mm": batched_experts,
    "grouped_mm": grouped_experts,
}
