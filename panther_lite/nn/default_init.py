"""The default initialisation shared by the sketched layers (no dense weight given).

Both layers start from the dense layer PyTorch would build — ``kaiming_uniform_(a=√5)``,
i.e. U(±1/√fan_in) for the weight and the bias — drawn on the CPU from the layer's
``seed`` when it has one, so a seeded layer is fully reproducible. After the weight is
represented in sketched form the trainable factors are rescaled so the *effective* weight
has the dense init's scale again: a random sketch adds noise of relative size
≈ √((fan_in + fan_out)/(4Lk)) (several times the weight for small ranks) and a truncated
SVD keeps only part of a random matrix's energy; either would change the scale of every
activation downstream.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["draw_dense_default", "fill_bias_default_", "rescale_to_default_"]


def draw_dense_default(shape: Sequence[int], fan_in: int, generator: Optional[torch.Generator]) -> Tensor:
    """A float32 CPU tensor of ``shape`` with ``nn.Linear``/``nn.Conv2d``'s weight init."""
    bound = 1 / math.sqrt(fan_in)
    return torch.empty(*shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def fill_bias_default_(bias: Optional[Tensor], fan_in: int, generator: Optional[torch.Generator]) -> None:
    """Fill ``bias`` in place with U(±1/√fan_in), drawn on the CPU."""
    if bias is not None:
        bound = 1 / math.sqrt(fan_in)
        bias.copy_(torch.empty(bias.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator))


@torch.no_grad()
def rescale_to_default_(effective_weight: Tensor, fan_in: int, factors: Sequence[Tensor]) -> None:
    """Scale ``factors`` (the trainable ones the effective weight is linear in) so that the
    effective weight's RMS is the dense init's ``1/√(3·fan_in)``."""
    rms = float(effective_weight.double().pow(2).mean().sqrt())
    if rms > 0:
        for factor in factors:
            factor.mul_(1 / (math.sqrt(3 * fan_in) * rms))
