"""``freeze``: the inference form of a converted model, each sketched layer rebuilt as a pair of
standard layers computing the same function, so every tool that knows ``nn.Linear`` and
``nn.ConvNd`` (``quantize_dynamic``, torchao's ``quantize_``, ONNX, TensorRT, ``torch.compile``,
``torch.export``) applies to it.

- :class:`~panther_lite.nn.SKLinear` (GPT-2 ``Conv1D`` replacements included) becomes
  :class:`FrozenLinear`: ``nn.Linear(in, 2Lk, bias=False)`` holding ``[S1 | U2]ᵀ`` then
  ``nn.Linear(2Lk, out)`` holding ``(scale·[U1; S2])ᵀ`` and the bias;
- ``SKConv1d``/``2d``/``3d`` become :class:`FrozenConv1d`/``2d``/``3d``: the layer's
  convolution to ``2Lk`` channels (its stride, padding, dilation and padding mode) holding
  ``S``, then a 1×…×1 convolution holding ``Uᵀ/(2L)`` and the bias.

Each intermediate channel's scale is balanced between the two layers (equal norms, the
function unchanged), so per-channel int8 quantization of either layer loses little.

One-way: the fixed sketches are folded into the second layer, so a frozen layer cannot be
turned back into a sketched one; keep training on the unfrozen model.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..nn import SKConv1d, SKConv2d, SKConv3d, SKLinear
from ..nn.factor_cache import concatenate_factors
from .hf_conv1d import SKLinearConv1D
from .kinds import SKETCHED_TYPES
from .quantized import warn_if_quantized_beside
from .surgery import swap_modules

__all__ = ["FrozenLinear", "FrozenConv1d", "FrozenConv2d", "FrozenConv3d", "FROZEN_TYPES", "freeze", "frozen_twin"]


class FrozenLinear(nn.Sequential):
    """A frozen :class:`~panther_lite.nn.SKLinear`: ``nn.Linear(in_features, 2Lk, bias=False)``
    then ``nn.Linear(2Lk, out_features, bias)``.

    ``num_terms``, ``low_rank``, ``has_bias`` and ``dense`` (``"Linear"``, or ``"Conv1D"`` for
    a GPT-2 layer) record what it was frozen from, for :func:`~panther_lite.conversion_config`
    (they stay readable after a quantizer replaced the two layers).

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
        """The effective dense weight, read-only and computed on each read, in the dense layer's
        layout (``(out_features, in_features)``; a GPT-2 ``Conv1D``'s ``(in, out)``), for code
        that reads a dense layer's weight (transformers' weight init, T5's dtype checks).
        Only while both layers hold float weights (not after a quantizer replaced them)."""
        weight = self[1].weight @ self[0].weight
        return weight.t() if self.dense == "Conv1D" else weight

    def extra_repr(self) -> str:
        return f"num_terms={self.num_terms}, low_rank={self.low_rank}"


class _FrozenConvNd(nn.Sequential):
    """A frozen sketched convolution: the layer's convolution to ``2Lk`` channels, then a
    1×…×1 convolution to ``out_channels`` with the bias. ``options`` are the dense
    convolution's constructor options (``in_channels``, ``out_channels``, ``kernel_size``,
    ``stride``, ``padding``, ``dilation``, ``bias``, ``padding_mode``); the attributes
    ``in_channels``, ``out_channels``, ``kernel_size``, ``has_bias``, ``num_terms`` and
    ``low_rank`` record what it was frozen from."""

    _conv_class: type = nn.Module
    dense: str = ""

    def __init__(self, options: Dict[str, object], num_terms: int, low_rank: int, dtype=None, device=None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        rank = 2 * num_terms * low_rank
        first = dict(options, out_channels=rank, bias=False)
        super().__init__(
            self._conv_class(**first, **factory_kwargs),
            self._conv_class(rank, options["out_channels"], 1, bias=options["bias"], **factory_kwargs),
        )
        self.in_channels, self.out_channels, self.has_bias = options["in_channels"], options["out_channels"], options["bias"]
        self.kernel_size, self.num_terms, self.low_rank = self[0].kernel_size, num_terms, low_rank

    @property
    def weight(self) -> Tensor:
        """The effective dense kernel ``(out_channels, in_channels, *kernel_size)``, read-only
        (see :attr:`FrozenLinear.weight`)."""
        first = self[0].weight
        return (self[1].weight.flatten(1) @ first.flatten(1)).view(self.out_channels, *first.shape[1:])

    def extra_repr(self) -> str:
        return f"num_terms={self.num_terms}, low_rank={self.low_rank}"


class FrozenConv1d(_FrozenConvNd):
    """A frozen :class:`~panther_lite.nn.SKConv1d`: ``nn.Conv1d`` to ``2Lk`` channels, then a 1-wide one."""

    _conv_class = nn.Conv1d
    dense = "Conv1d"


class FrozenConv2d(_FrozenConvNd):
    """A frozen :class:`~panther_lite.nn.SKConv2d`: ``nn.Conv2d`` to ``2Lk`` channels, then a 1×1 one."""

    _conv_class = nn.Conv2d
    dense = "Conv2d"


class FrozenConv3d(_FrozenConvNd):
    """A frozen :class:`~panther_lite.nn.SKConv3d`: ``nn.Conv3d`` to ``2Lk`` channels, then a 1×1×1 one."""

    _conv_class = nn.Conv3d
    dense = "Conv3d"


FROZEN_TYPES = (FrozenLinear, FrozenConv1d, FrozenConv2d, FrozenConv3d)
_FROZEN_CONV = {SKConv1d: FrozenConv1d, SKConv2d: FrozenConv2d, SKConv3d: FrozenConv3d}


def _balanced(first: Tensor, second: Tensor) -> Tuple[Tensor, Tensor]:
    """The pair's weights with intermediate channel ``j`` rescaled — row ``j`` of ``first``
    ``(2Lk, ...)`` by ``d_j``, column ``j`` of ``second`` ``(out, 2Lk, ...)`` by ``1/d_j`` — so
    that both hold the same norm. The function is unchanged, but no channel is tiny in one
    layer and large in the other: the sketched factors are far from balanced (an orthonormal
    ``U2`` beside an ``S2`` holding the singular values), which per-channel int8 weights
    represent badly."""
    first_norms = first.flatten(1).float().norm(dim=1)  # float32: a float16 sum of squares overflows
    second_norms = second.transpose(0, 1).flatten(1).float().norm(dim=1)
    usable = (first_norms > 0) & (second_norms > 0)
    scale = torch.where(usable, (second_norms / first_norms.where(usable, 1)).sqrt(), 1).to(first.dtype)
    first = first * scale.view(-1, *(1,) * (first.dim() - 1))
    return first, second / scale.view(1, -1, *(1,) * (second.dim() - 2))


def _frozen_linear(layer: SKLinear) -> FrozenLinear:
    dtype, device = layer.S1.dtype, layer.S1.device
    dense = "Conv1D" if isinstance(layer, SKLinearConv1D) else "Linear"
    frozen = nn.utils.skip_init(
        FrozenLinear, layer.in_features, layer.out_features, layer.num_terms, layer.low_rank,
        layer.bias is not None, dtype=dtype, device=device, dense=dense,
    )
    left, right = concatenate_factors(layer.S1, layer.U1.to(dtype), layer.U2.to(dtype), layer.S2, layer.scale)
    first, second = _balanced(left.t(), right.t())
    with torch.no_grad():
        frozen[0].weight.copy_(first)
        frozen[1].weight.copy_(second)
    return frozen


def _frozen_conv(layer: nn.Module) -> _FrozenConvNd:
    frozen_class = _FROZEN_CONV[type(layer)]
    frozen = nn.utils.skip_init(
        frozen_class, layer._dense_options(), layer.num_terms, layer.low_rank, dtype=layer.S.dtype, device=layer.S.device
    )
    with torch.no_grad():
        first, second = _balanced(layer.S, layer._mix_matrix().view_as(frozen[1].weight))
        frozen[0].weight.copy_(first)
        frozen[1].weight.copy_(second)
    return frozen


def frozen_twin(layer: nn.Module) -> nn.Module:
    """The frozen pair computing what the sketched ``layer`` computes (same dtype and device,
    trainability and training mode; on the meta device it holds no values)."""
    frozen = _frozen_linear(layer) if isinstance(layer, SKLinear) else _frozen_conv(layer)
    with torch.no_grad():
        if layer.bias is not None:
            frozen[1].bias.copy_(layer.bias)
    trainable = any(p.requires_grad for p in layer.parameters())
    frozen.requires_grad_(trainable).train(layer.training)
    return frozen


def _sketched_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(fqn, module) for fqn, module in model.named_modules() if isinstance(module, SKETCHED_TYPES)]


def freeze(model: nn.Module) -> nn.Module:
    """Replace every sketched layer of ``model`` with its frozen pair of standard layers, in place.

    Each frozen layer computes the same function as the sketched one (up to float rounding):
    :class:`FrozenLinear` for ``SKLinear`` (two ``nn.Linear``), :class:`FrozenConv1d`/``2d``/
    ``3d`` for the convolutions (a convolution to ``2Lk`` channels, then a 1×…×1 one). The
    stored size is the sketched layer's, with the fixed sketches folded in. Quantizers that
    handle ``nn.Linear``/``nn.ConvNd`` then apply: ``quantize_dynamic(model, {nn.Linear})``
    quantizes two ``nn.Linear`` per sketched linear layer.

    One-way: the frozen model cannot be unfrozen (train the unfrozen one).
    :func:`~panther_lite.save_pretrained` and :func:`~panther_lite.from_pretrained` save and
    rebuild it. A model holding no sketched layer is returned unchanged. The swap is all or
    nothing; a shared layer stays shared. Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = _sketched_layers(model)
    if any(fqn == "" for fqn, _ in layers):
        raise ValueError(
            "the root module is a sketched layer: freeze() replaces layers inside a model; "
            "use panther_lite.conversion.freezing.frozen_twin(layer) for a lone layer"
        )
    warn_if_quantized_beside(model, [fqn for fqn, _ in layers], "freeze")
    # named_modules lists a shared layer once; swap_modules replaces it at every alias
    swap_modules(model, [(fqn, frozen_twin(layer)) for fqn, layer in layers])
    return model
