"""Sketched layouts without fitting, for benchmarks whose measure does not depend on the values
(loading memory, speed): the conversion config that gives every ``nn.Linear`` under a prefix the
size ``convert`` picks for a ``param_ratio``.

Example::

    conversion = ratio_layout(model.model.layers, 0.5, prefix="model.layers")
    panther_lite.apply_conversion_config(model, conversion)   # placeholders, or meta shells on meta
"""
from __future__ import annotations

import torch.nn as nn

from ..conversion.saving.serialization import CONFIG_FORMAT, CONFIG_VERSION
from ..nn import select_config

__all__ = ["ratio_layout"]


def ratio_layout(module: nn.Module, param_ratio: float, prefix: str = "") -> dict:
    """The conversion config sketching every bias-free or biased ``nn.Linear`` inside
    ``module`` (names under ``prefix``) at ``num_terms=1`` and the largest ``low_rank`` whose
    stored size is at most ``param_ratio`` of the dense layer's
    (:func:`~panther_lite.nn.select_config`); layers where nothing fits stay dense."""
    layers = []
    for name, linear in module.named_modules(prefix=prefix):
        if not isinstance(linear, nn.Linear):
            continue
        bias = linear.bias is not None
        size = select_config(linear.in_features, linear.out_features, param_ratio, num_terms=1, bias=bias)
        if size is not None:
            layers.append(dict(name=name, kind="SKLinear", dense="Linear", shape=list(linear.weight.shape),
                               num_terms=size[0], low_rank=size[1], bias=bias))
    return dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=layers)
