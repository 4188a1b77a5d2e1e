"""The convolution kinds: ``nn.Conv1d``/``2d``/``3d``, sketched as ``SKConv1d``/``2d``/``3d``
and frozen as :class:`FrozenConv1d`/``2d``/``3d``. A convolution's rows are its unfolded input
patches, ordered ``C_in·k1·k2·…`` like the kernel's unfolding ``weight.reshape(C_out, -1)``."""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ...nn import SKConv1d, SKConv2d, SKConv3d
from .base import LayerKind, balanced_pair, pair_bias

__all__ = ["FrozenConv1d", "FrozenConv2d", "FrozenConv3d", "ConvKind", "CONV1D", "CONV2D", "CONV3D", "conv_patches"]

# Per-chunk bound on the unfolded patches of a convolution's input (entries), so the
# Gram of a large feature map is accumulated in slices of the batch.
_MAX_PATCH_ENTRIES = 1 << 24


def _first_conv(name: str) -> property:
    return property(lambda self: getattr(self[0], name), doc=f"The dense convolution's ``{name}`` (the first layer's).")


class _FrozenConvNd(nn.Sequential):
    """A frozen sketched convolution: the layer's convolution to ``2Lk`` channels, then a
    1×…×1 convolution to ``out_channels`` with the bias. ``options`` are the dense
    convolution's constructor options (``in_channels``, ``out_channels``, ``kernel_size``,
    ``stride``, ``padding``, ``dilation``, ``bias``, ``padding_mode``); the attributes
    ``in_channels``, ``out_channels``, ``kernel_size``, ``has_bias``, ``num_terms`` and
    ``low_rank`` record what it was frozen from. Like ``nn.ConvNd`` it also has ``stride``,
    ``padding``, ``dilation``, ``groups``, ``padding_mode``, ``transposed``, ``output_padding``
    (read-only, the first layer's), ``weight`` (the effective kernel) and ``bias``."""

    stride, padding, dilation = _first_conv("stride"), _first_conv("padding"), _first_conv("dilation")
    groups, padding_mode = _first_conv("groups"), _first_conv("padding_mode")
    transposed, output_padding = _first_conv("transposed"), _first_conv("output_padding")
    bias = property(pair_bias, doc="The bias ``(out_channels,)`` (the second layer's), or None.")

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
        (see :attr:`~panther_lite.conversion.FrozenLinear.weight`)."""
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


def conv_patches(conv: nn.Module, x: Tensor) -> Tensor:
    """Unfolded input patches ``(N·positions, C_in·k1·k2·…)`` of an N-d convolution (the
    order of ``conv.weight.reshape(C_out, -1)``), padded as the convolution pads."""
    spatial = len(conv.kernel_size)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    for dim, (size, stride, dilation) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation)):
        x = x.unfold(2 + dim, dilation * (size - 1) + 1, stride)[..., ::dilation]
    # x: (N, C_in, out_1..out_n, k_1..k_n) -> rows (N, out_1..out_n) of columns (C_in, k_1..k_n)
    order = (0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    return x.permute(order).reshape(-1, conv.weight[0].numel())


class ConvKind(LayerKind):
    """``nn.Conv{dims}d``: the kernel's unfolding ``C_out × (C_in·k1·…)`` is the weight matrix."""

    def __init__(self, dims: int, dense_type: type, sketched_type: type, frozen_type: type) -> None:
        super().__init__(
            f"Conv{dims}d", dense_type, sketched_type, frozen_type=frozen_type, overridden=("forward", "_conv_forward")
        )
        self.dims = dims

    def unsupported(self, module: nn.Module) -> Optional[str]:
        groups = getattr(module, "groups", 1)
        if groups != 1:
            return f"{self.sketched_type.__name__} supports only groups=1, this convolution has groups={groups}"
        return None

    def weight_matrix(self, module: nn.Module) -> Tensor:
        return module.weight.reshape(module.weight.shape[0], -1)

    def input_dimension(self, module: nn.Module) -> Tuple[int, int, str]:
        return -len(module.kernel_size) - 1, module.in_channels, "channels"

    def input_rows(self, module: nn.Module, x: Tensor) -> Iterator[Tuple[Tensor, int]]:
        if x.dim() == len(module.kernel_size) + 1:  # unbatched
            x = x.unsqueeze(0)
        step = max(1, _MAX_PATCH_ENTRIES // max(1, x[:1].numel() * math.prod(module.kernel_size)))
        for chunk in x.split(step):
            yield conv_patches(module, chunk), 1

    def build(self, module: nn.Module, num_terms: int, low_rank: int, **fit) -> nn.Module:
        return getattr(self.built_type, f"from_conv{self.dims}d")(module, num_terms, low_rank, **fit)

    def build_placeholder(self, module: nn.Module, num_terms: int, low_rank: int, device=None) -> nn.Module:
        return self.built_type(
            **self.built_type._options_from_dense(module), num_terms=num_terms, low_rank=low_rank,
            dtype=module.weight.dtype, device=module.weight.device if device is None else device,
        )

    def frozen_pair(self, layer: nn.Module) -> _FrozenConvNd:
        frozen = nn.utils.skip_init(
            self.frozen_type, layer._dense_options(), layer.num_terms, layer.low_rank, dtype=layer.S.dtype,
            device=layer.S.device,
        )
        with torch.no_grad():
            first, second = balanced_pair(layer.S, layer._mix_matrix().view_as(frozen[1].weight))
            frozen[0].weight.copy_(first)
            frozen[1].weight.copy_(second)
        return frozen

    def dense_shape(self, layer: nn.Module) -> List[int]:
        return [layer.out_channels, layer.in_channels, *layer.kernel_size]


CONV1D = ConvKind(1, nn.Conv1d, SKConv1d, FrozenConv1d)
CONV2D = ConvKind(2, nn.Conv2d, SKConv2d, FrozenConv2d)
CONV3D = ConvKind(3, nn.Conv3d, SKConv3d, FrozenConv3d)
