"""The frozen form of :class:`~panther_lite.nn.SKExperts`: per projection, plain stacked low-rank
factors (the fixed sketches folded in) and a forward made of standard operations over a static
loop of experts, so both ONNX exporters export it and onnxruntime runs it."""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from torch import Tensor

from ...nn import SKExperts
from ...nn.factor_cache import concatenate_factors
from ...nn.experts_shell import ShellHolder, copy_sharing_config, expert_activation, expert_finish
from .base import balanced_pair

__all__ = ["FrozenExperts", "FrozenStackedLinear"]


class FrozenStackedLinear(nn.Module):
    """One frozen projection of a mixture-of-experts layer: expert ``e`` maps ``x`` ``(S, in)``
    to ``x·left[e]·right[e] + bias[e]``, with ``left`` ``(E, in, 2Lk)``, ``right``
    ``(E, 2Lk, out)`` and ``bias`` ``(E, out)`` (or None); ``num_terms``, ``low_rank`` and
    ``dense_shape`` (the dense ``(E, out, in)``, or ``(E, in, out)`` transposed, layout) record
    what it was frozen from."""

    def __init__(self, layer, dtype=None, device=None) -> None:
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        experts, rank = layer.num_experts, 2 * layer.num_terms * layer.low_rank
        self.num_terms, self.low_rank, self.dense_shape = layer.num_terms, layer.low_rank, list(layer.dense_weight_shape)
        self.left = nn.Parameter(torch.empty(experts, layer.in_features, rank, **factory_kwargs))
        self.right = nn.Parameter(torch.empty(experts, rank, layer.out_features, **factory_kwargs))
        has_bias = layer.bias is not None
        self.bias = nn.Parameter(torch.empty(experts, layer.out_features, **factory_kwargs)) if has_bias else None

    @torch.no_grad()
    def copy_from(self, layer) -> None:
        """Fold ``layer``'s (an :class:`~panther_lite.nn.SKStackedLinear`) factors in, each
        expert's intermediate channels balanced between ``left`` and ``right``."""
        dtype = layer.S1.dtype
        left, right = concatenate_factors(layer.S1, layer.U1.to(dtype), layer.U2.to(dtype), layer.S2, layer.scale)
        for e in range(left.shape[0]):
            first, second = balanced_pair(left[e].t(), right[e].t())
            self.left[e].copy_(first.t())
            self.right[e].copy_(second.t())
        if self.bias is not None:
            self.bias.copy_(layer.bias)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on rows ``x`` ``(S, in) -> (S, out)``."""
        y = x @ self.left[e] @ self.right[e]
        return y if self.bias is None else y + self.bias[e]

    def extra_repr(self) -> str:
        return f"num_experts={self.left.shape[0]}, num_terms={self.num_terms}, low_rank={self.low_rank}"


class FrozenExperts(ShellHolder):
    """A frozen :class:`~panther_lite.nn.SKExperts` (:func:`~panther_lite.freeze`): the same
    forward ``(hidden_states (T, hidden), top_k_index (T, K), top_k_weights (T, K)) -> (T, hidden)``
    with each projection a :class:`FrozenStackedLinear` of the same name, and the dense module's
    activation, gate and post-expert norm (``shell``, sharing the model's ``config``).

    The forward loops over every expert (a static loop, not one over the experts that received
    tokens), gathers its tokens, applies it and adds the weighted rows back (``index_add``):
    standard operations both ONNX exporters handle. ``sizes``, ``has_bias``, ``num_experts``
    and ``dense`` (``"Experts"``, its layer kind) record what it was frozen from.
    """

    dense = "Experts"

    def __init__(self, layer: SKExperts) -> None:
        super().__init__()
        reference = layer.projections()[0].S1
        self.hold_shell(copy_sharing_config(layer.shell), reference.device, reference.dtype)
        self._projection_names = tuple(layer.sizes)
        for name, projection in zip(self._projection_names, layer.projections()):
            self.add_module(name, FrozenStackedLinear(projection, dtype=reference.dtype, device=reference.device))
        self.num_experts, self.sizes = layer.num_experts, layer.sizes
        self.has_bias = layer.projections()[0].bias is not None

    @classmethod
    def from_sketched(cls, layer: SKExperts) -> "FrozenExperts":
        """The frozen form computing what ``layer`` computes (same dtype and device; on the meta
        device it holds no values)."""
        frozen = cls(layer)
        for projection, source in zip(frozen.projections(), layer.projections()):
            projection.copy_from(source)
        return frozen

    def projections(self) -> List[FrozenStackedLinear]:
        return [self._modules[name] for name in self._projection_names]

    @property
    def dense_shape(self) -> List[int]:
        """The dense shape of the first projection (``gate_up_proj`` or ``up_proj``)."""
        return self.projections()[0].dense_shape

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        up, down = self.projections()
        final = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, position = torch.where(top_k_index == e)
            rows = up.expert(e, hidden_states[token])
            rows = expert_finish(self.shell, down.expert(e, expert_activation(self.shell, rows)))
            rows = rows * top_k_weights[token, position].unsqueeze(-1)
            final = final.index_add(0, token, rows.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, sizes={self.sizes}"

