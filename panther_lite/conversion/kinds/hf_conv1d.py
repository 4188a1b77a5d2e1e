"""The kind of Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): a
linear layer whose weight is stored ``(in, out)`` with forward ``addmm(bias, x, weight)``.

It is recognised by its class's module and name, so transformers is never imported to
detect it (a model holding a Conv1D has imported transformers already). It converts to
:class:`SKLinearConv1D`, an SKLinear of the transposed weight that keeps Conv1D's layout
for code reading ``.weight`` (frozen: :class:`FrozenLinearConv1D`), and densifies back to a Conv1D.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...nn import SKLinear
from .linear import FrozenLinear, LinearKind

__all__ = ["HF_CONV1D", "HFConv1DKind", "SKLinearConv1D", "FrozenLinearConv1D"]

HF_CONV1D_MODULE = "transformers.pytorch_utils"


def hf_conv1d_base(module_type: type) -> Optional[type]:
    """The ``transformers.pytorch_utils.Conv1D`` class in ``module_type``'s MRO, or None."""
    for cls in module_type.__mro__:
        if cls.__name__ == "Conv1D" and cls.__module__ == HF_CONV1D_MODULE:
            return cls
    return None


def hf_conv1d_twin(layer: SKLinear) -> nn.Module:
    """A ``transformers`` Conv1D computing what ``layer`` computes (weight transposed to
    ``(in, out)``), or an ``nn.Linear`` when transformers cannot be imported. A Conv1D
    always has a bias: a bias-free layer gets a zero bias."""
    try:
        conv1d_class = importlib.import_module(HF_CONV1D_MODULE).Conv1D
    except ImportError:
        return layer.to_dense()
    weight = layer.effective_weight().detach()
    with torch.device("meta"):
        twin = conv1d_class(layer.out_features, layer.in_features)
    twin.weight = nn.Parameter(weight.t().contiguous())
    bias = torch.zeros_like(weight[:, 0]) if layer.bias is None else layer.bias.detach().clone()
    twin.bias = nn.Parameter(bias)
    return twin


class SKLinearConv1D(SKLinear):
    """An :class:`~panther_lite.nn.SKLinear` standing for a transformers ``Conv1D``: the same
    layer (parameters, buffers, state_dict keys, forward ``x·Wᵀ + b``), except that the
    read-only ``weight`` has Conv1D's ``(in_features, out_features)`` layout, so code written
    for the Conv1D reads the right matrix (the transposed view costs nothing beyond
    SKLinear's ``weight``)."""

    @property
    def weight(self) -> Tensor:
        return SKLinear.weight.fget(self).t()


class FrozenLinearConv1D(FrozenLinear):
    """A frozen :class:`SKLinearConv1D`: a :class:`~panther_lite.conversion.FrozenLinear` whose
    read-only ``weight`` has Conv1D's ``(in_features, out_features)`` layout."""

    @property
    def weight(self) -> Tensor:
        return FrozenLinear.weight.fget(self).t()


class HFConv1DKind(LinearKind):
    """transformers' ``Conv1D``: a linear layer with its weight stored ``(in, out)``."""

    def base(self, module_type: type) -> Optional[type]:
        return hf_conv1d_base(module_type)

    def weight_matrix(self, module: nn.Module) -> Tensor:
        return module.weight.t()

    def dense_twin(self, layer: nn.Module) -> nn.Module:
        return hf_conv1d_twin(layer)

    def dense_shape(self, layer: nn.Module) -> list:
        return [layer.in_features, layer.out_features]


HF_CONV1D = HFConv1DKind("Conv1D", nn.Module, built_type=SKLinearConv1D, frozen_type=FrozenLinearConv1D)
