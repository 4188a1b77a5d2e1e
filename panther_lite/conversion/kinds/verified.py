"""Verifying that a subclass of a linear layer that overrides ``forward`` (Falcon's
``FalconLinear``, a user's logging wrapper) still computes the linear map of its weight and
bias, so it can convert like its base class: its forward is run on random probe inputs (two
shapes, two scales, in training and in eval mode) and compared with ``x·Wᵀ + b``. Anything
else — a constant added, a nonlinearity, dropout, a rescaling — differs on them."""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear_forward_problem", "PROBE_TOLERANCE"]

# Largest relative difference from x·Wᵀ + b a verified forward may show, by the weight's dtype
# (a reordered sum differs by rounding only).
PROBE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _probe_module(module: nn.Module, weight: Tensor) -> nn.Module:
    """``module`` itself, or, while its weights are on the meta device (loaded later), a copy
    on the CPU with random weights (the class's forward is what is verified)."""
    if not weight.is_meta:
        return module
    probe = copy.deepcopy(module).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in (*probe.parameters(), *probe.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
    return probe


def _difference(module: nn.Module, kind, x: Tensor) -> float:
    """Relative difference of ``module``'s own forward on ``x`` from ``x·Wᵀ + b`` (hooks bypassed)."""
    output = type(module).forward(module, x)
    expected = F.linear(x, kind.weight_matrix(module), kind.bias(module))
    if not isinstance(output, Tensor) or output.shape != expected.shape:
        return float("inf")
    scale = expected.double().norm().clamp_min(torch.finfo(torch.float64).tiny)
    return float((output.double() - expected.double()).norm() / scale)


def linear_forward_problem(module: nn.Module, kind) -> Optional[str]:
    """None when ``module``'s forward computes ``x·Wᵀ + b`` (``W`` the ``kind``'s weight matrix)
    on the probe inputs, else what differs."""
    weight = kind.weight(module)
    probe = _probe_module(module, weight)
    weight = kind.weight(probe)
    generator = torch.Generator(device=weight.device).manual_seed(0)
    fan_in = kind.weight_matrix(probe).shape[1]
    tolerance = PROBE_TOLERANCE.get(weight.dtype, 1e-4)
    training = probe.training
    try:
        with torch.no_grad():
            for mode in (training, not training):
                probe.train(mode)
                for shape, scale in (((3, fan_in), 1.0), ((2, 4, fan_in), 100.0)):
                    x = scale * torch.randn(shape, generator=generator, device=weight.device, dtype=weight.dtype)
                    difference = _difference(probe, kind, x)
                    if not difference <= tolerance:
                        where = "training" if mode else "eval"
                        return f"its forward differs from x·Wᵀ + b on probe inputs in {where} mode (relative difference {difference:.3g})"
    except Exception as error:  # the forward fails on an input its weight accepts: not a plain linear map
        return f"its forward fails on probe inputs ({type(error).__name__}: {error})"
    finally:
        probe.train(training)
    return None
