"""Layer kinds: one registry saying, for each type of dense layer convert can replace, how it is
recognised, read, sketched, frozen, densified and saved (:class:`LayerKind`); the built-in kinds
(``nn.Linear``, transformers' ``Conv1D``, ``nn.Conv1d``/``2d``/``3d``, transformers'
mixture-of-experts modules) and
:func:`register_kind` for a user's own layer type."""
from .base import LayerKind
from .experts import EXPERTS, ExpertsKind, ExpertsPart, ExpertsRecord
from .frozen_experts import FrozenExperts
from .conv import CONV1D, CONV2D, CONV3D, ConvKind, FrozenConv1d, FrozenConv2d, FrozenConv3d
from .hf_conv1d import HF_CONV1D, FrozenLinearConv1D, SKLinearConv1D
from .linear import LINEAR, FrozenLinear, LinearKind
from .registry import (
    converted_kind, default_kind_for, frozen_types, kind_named, kind_of, register_kind, registered_kinds,
    sketched_types, unregister_kind,
)

__all__ = [
    "LayerKind", "LinearKind", "ConvKind", "register_kind", "unregister_kind", "registered_kinds", "kind_of",
    "kind_named", "converted_kind", "sketched_types", "frozen_types", "default_kind_for",
    "FrozenLinear", "FrozenLinearConv1D", "FrozenConv1d", "FrozenConv2d", "FrozenConv3d", "SKLinearConv1D",
    "LINEAR", "HF_CONV1D", "CONV1D", "CONV2D", "CONV3D", "EXPERTS", "ExpertsKind", "ExpertsRecord", "ExpertsPart",
    "FrozenExperts",
]

for _kind in (LINEAR, HF_CONV1D, CONV1D, CONV2D, CONV3D, EXPERTS):
    register_kind(_kind)
