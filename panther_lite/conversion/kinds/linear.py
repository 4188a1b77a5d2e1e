"""The linear kinds: layers computing ``x·Wᵀ + b`` (``nn.Linear``, and any layer a
:class:`LinearKind` describes), sketched as :class:`~panther_lite.nn.SKLinear` and frozen as
:class:`FrozenLinear`."""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn import SKLinear
from ...nn.factor_cache import concatenate_factors
from .base import LayerKind, balanced_pair, pair_bias
from .verified import linear_forward_problem

__all__ = ["FrozenLinear", "LinearKind", "LINEAR", "cluster_size"]


def cluster_size(x: Tensor) -> int:
    """Rows per cluster of a linear layer's input ``x`` (``(..., fan_in)``): the sequence
    length ``T`` of a ``(..., T, fan_in)`` input, else 1."""
    return x.shape[-2] if x.dim() >= 3 else 1


class FrozenLinear(nn.Sequential):
    """A frozen :class:`~panther_lite.nn.SKLinear`: ``nn.Linear(in_features, 2Lk, bias=False)``
    then ``nn.Linear(2Lk, out_features, bias)``.

    ``num_terms``, ``low_rank``, ``has_bias`` and ``dense`` (the layer kind it was frozen
    from: ``"Linear"``, ``"Conv1D"`` for a GPT-2 layer, ...) record what it was frozen from,
    for :func:`~panther_lite.conversion_config` (they stay readable after a quantizer replaced
    the two layers). Like ``nn.Linear`` it has ``in_features``, ``out_features``, ``weight``
    (the effective weight, read-only) and ``bias`` (the second layer's, or None).

    Shape: input ``(*, in_features)``, output ``(*, out_features)``.
    """

    def __init__(
        self, in_features: int, out_features: int, num_terms: int, low_rank: int, bias: bool = True,
        dtype=None, device=None, *, dense: str = "Linear",
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        rank = 2 * num_terms * low_rank
        super().__init__(
            nn.Linear(in_features, rank, bias=False, **factory_kwargs),
            nn.Linear(rank, out_features, bias=bias, **factory_kwargs),
        )
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.num_terms, self.low_rank, self.dense = num_terms, low_rank, dense

    @property
    def weight(self) -> Tensor:
        """The effective dense weight ``(out_features, in_features)``, read-only and computed
        on each read, for code that reads a dense layer's weight (transformers' weight init,
        T5's dtype checks). Only while both layers hold float weights (not after a quantizer
        replaced them)."""
        return self[1].weight @ self[0].weight

    bias = property(pair_bias, doc="The bias ``(out_features,)`` (the second layer's), or None.")

    def extra_repr(self) -> str:
        return f"num_terms={self.num_terms}, low_rank={self.low_rank}"


def _linear_view(weight: Tensor, bias: Optional[Tensor]) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` ``(out, in)`` (detached, no copy) and ``bias``:
    what ``SKLinear.from_linear`` fits."""
    fan_out, fan_in = weight.shape
    with torch.device("meta"):
        linear = nn.Linear(fan_in, fan_out, bias=bias is not None)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
    if bias is not None:
        linear.bias = bias
    return linear


class LinearKind(LayerKind):
    """A layer computing ``x·Wᵀ + b`` on the last dimension of its input: sketched as
    ``built_type`` (default :class:`~panther_lite.nn.SKLinear`) from an ``nn.Linear`` view
    of :meth:`weight_matrix`, frozen as ``frozen_type`` (default :class:`FrozenLinear`).
    A layer whose weight is not stored ``(out, in)`` overrides :meth:`weight_matrix`; one
    that should densify to its own class overrides :meth:`dense_twin`."""

    output_features_last = True

    def __init__(self, name: str, dense_type: type, **options) -> None:
        options.setdefault("frozen_type", FrozenLinear)
        options.setdefault("linear", True)
        options.setdefault("row_group", "features")
        super().__init__(name, dense_type, options.pop("sketched_type", SKLinear), **options)

    def weight_matrix(self, module: nn.Module) -> Tensor:
        return self.weight(module)

    def custom_behaviour(self, module: nn.Module) -> Optional[str]:
        """As :meth:`LayerKind.custom_behaviour`, except that a subclass overriding only
        ``forward`` converts when that forward is verified to compute ``x·Wᵀ + b`` on probe
        inputs (:func:`~panther_lite.conversion.kinds.verified.linear_forward_problem`)."""
        reason = super().custom_behaviour(module)
        if reason is None or not self._overrides_forward_only(module):
            return reason
        problem = linear_forward_problem(module, self)
        if problem is None:
            return None
        return (
            f"{reason}: {problem}; if it is a linear map stored another way, register a LayerKind for it "
            "(panther_lite.register_kind)"
        )

    def behaviour_note(self, module: nn.Module) -> str:
        if self._overrides_forward_only(module) and type(module).forward is not self.base(type(module)).forward:
            return f"verified linear: {type(module).__name__}.forward computes x·Wᵀ + b on probe inputs"
        return ""

    def _overrides_forward_only(self, module: nn.Module) -> bool:
        base = self.base(type(module))
        others = [method for method in self.overridden if method != "forward"]
        return base is not None and all(getattr(type(module), m) is getattr(base, m) for m in others)

    def as_linear(self, module: nn.Module) -> nn.Module:
        """The ``nn.Linear`` the sketched class's ``from_linear`` fits (a view: no copy)."""
        return _linear_view(self.weight_matrix(module), self.bias(module))

    def input_rows(self, module: nn.Module, x: Tensor) -> Iterator[Tuple[Tensor, int]]:
        yield x.reshape(-1, x.shape[-1]), cluster_size(x)

    def token_rows(self, module: nn.Module, x: Tensor, mask: Tensor) -> Optional[Tuple[Tensor, int]]:
        """An input ``(batch, seq, fan_in)`` whose leading dimensions are the mask's: its rows,
        padded ones zeroed, one cluster per sequence."""
        if tuple(x.shape[:-1]) != tuple(mask.shape):
            return None
        return torch.where(mask.unsqueeze(-1), x, 0).reshape(-1, x.shape[-1]), x.shape[-2]

    def build(self, module: nn.Module, num_terms: int, low_rank: int, **fit) -> nn.Module:
        return self.built_type.from_linear(self.as_linear(module), num_terms, low_rank, **fit)

    def build_placeholder(self, module: nn.Module, num_terms: int, low_rank: int, device=None) -> nn.Module:
        weight = self.weight(module)
        return self.built_type(
            **self.built_type._options_from_dense(self.as_linear(module)), num_terms=num_terms, low_rank=low_rank,
            dtype=weight.dtype, device=weight.device if device is None else device,
        )

    def frozen_pair(self, layer: SKLinear) -> FrozenLinear:
        dtype, device = layer.S1.dtype, layer.S1.device
        frozen = nn.utils.skip_init(
            self.frozen_type, layer.in_features, layer.out_features, layer.num_terms, layer.low_rank,
            layer.bias is not None, dtype=dtype, device=device, dense=self.name,
        )
        left, right = concatenate_factors(layer.S1, layer.U1.to(dtype), layer.U2.to(dtype), layer.S2, layer.scale)
        first, second = balanced_pair(left.t(), right.t())
        with torch.no_grad():
            frozen[0].weight.copy_(first)
            frozen[1].weight.copy_(second)
        return frozen

    def dense_shape(self, layer: nn.Module) -> List[int]:
        return [layer.out_features, layer.in_features]


class _TorchLinearKind(LinearKind):
    """``nn.Linear`` itself: fitted from the module as it is."""

    def as_linear(self, module: nn.Module) -> nn.Module:
        return module


LINEAR = _TorchLinearKind("Linear", nn.Linear)
