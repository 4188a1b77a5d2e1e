"""The dense layer kinds convert handles: how each is recognised, read as a weight matrix,
turned into its sketched replacement and rebuilt as a dense twin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch.nn as nn
from torch import Tensor

from ..nn import SKConv1d, SKConv2d, SKConv3d, SKLinear
from .hf_conv1d import SKLinearConv1D, hf_conv1d_base, hf_conv1d_twin, linear_view


def _unchanged(module: nn.Module) -> nn.Module:
    return module


@dataclass(frozen=True)
class LayerKind:
    """One kind of dense layer convert can replace.

    Attributes:
        name: the report's ``kind`` and the config's ``dense`` field.
        sketched: the replacement's class; its name is the config's ``kind``.
        base: ``base(module_type)``: the class of this kind in ``module_type``'s MRO, or None.
        overridden: methods of ``base`` a subclass must not override (the sketched layer
            would drop that custom behaviour).
        weight_matrix: the module's weight as a ``(fan_out, fan_in)`` matrix (a view).
        constructor: the classmethod of the replacement class that fits it to a dense layer.
        dense_view: the dense layer ``constructor`` accepts, made from the module.
        replacement: the class built, when it is a subclass of ``sketched``.
        dense_twin: the dense layer a sketched layer of this kind densifies to.
    """

    name: str
    sketched: type
    base: Callable[[type], Optional[type]]
    overridden: Tuple[str, ...]
    weight_matrix: Callable[[nn.Module], Tensor]
    constructor: str
    dense_view: Callable[[nn.Module], nn.Module] = _unchanged
    replacement: Optional[type] = None
    dense_twin: Callable[[nn.Module], nn.Module] = lambda layer: layer.to_dense()

    def matches(self, module: nn.Module) -> bool:
        return self.base(type(module)) is not None

    def build(self, module: nn.Module, num_terms: int, low_rank: int, **options) -> nn.Module:
        """The fitted replacement of ``module`` (``options``: ``init``, ``seed``, ``gram``, ...
        as the layer's ``from_*`` classmethod takes them)."""
        cls = self.replacement or self.sketched
        return getattr(cls, self.constructor)(self.dense_view(module), num_terms, low_rank, **options)

    def build_placeholder(self, module: nn.Module, num_terms: int, low_rank: int, device=None) -> nn.Module:
        """A sketched layer of ``module``'s shape and options, on its dtype and device (or
        ``device``), that is not fitted (its values are placeholders for a state_dict; on
        the meta device it holds none)."""
        cls = self.replacement or self.sketched
        return cls(
            **cls._options_from_dense(self.dense_view(module)),
            num_terms=num_terms,
            low_rank=low_rank,
            dtype=module.weight.dtype,
            device=module.weight.device if device is None else device,
        )


def _subclass_of(cls: type) -> Callable[[type], Optional[type]]:
    return lambda module_type: cls if issubclass(module_type, cls) else None


def _conv_matrix(conv: nn.Module) -> Tensor:
    return conv.weight.reshape(conv.weight.shape[0], -1)


def _conv_kind(dims: int, dense: type, sketched: type) -> LayerKind:
    return LayerKind(
        f"Conv{dims}d", sketched, _subclass_of(dense), ("forward", "_conv_forward"), _conv_matrix, f"from_conv{dims}d"
    )


LINEAR = LayerKind("Linear", SKLinear, _subclass_of(nn.Linear), ("forward",), lambda m: m.weight, "from_linear")
HF_CONV1D = LayerKind(
    "Conv1D", SKLinear, hf_conv1d_base, ("forward",), lambda m: m.weight.t(), "from_linear",
    dense_view=linear_view, replacement=SKLinearConv1D, dense_twin=hf_conv1d_twin,
)
CONV1D = _conv_kind(1, nn.Conv1d, SKConv1d)
CONV2D = _conv_kind(2, nn.Conv2d, SKConv2d)
CONV3D = _conv_kind(3, nn.Conv3d, SKConv3d)

KINDS: Tuple[LayerKind, ...] = (LINEAR, HF_CONV1D, CONV1D, CONV2D, CONV3D)
LINEAR_KINDS = (LINEAR, HF_CONV1D)
KIND_BY_NAME = {kind.name: kind for kind in KINDS}
SKETCHED_TYPES = tuple(dict.fromkeys(kind.sketched for kind in KINDS))


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of ``module``, or None when convert cannot replace it."""
    return next((kind for kind in KINDS if kind.matches(module)), None)


def dense_kind_of(sketched: nn.Module) -> LayerKind:
    """The kind of dense layer a sketched layer stands for."""
    if isinstance(sketched, SKLinearConv1D):
        return HF_CONV1D
    return next(kind for kind in KINDS if isinstance(sketched, kind.sketched))
