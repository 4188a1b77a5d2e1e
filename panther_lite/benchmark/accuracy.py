"""Accuracy of a sketched layer: trained-like dense weights with a decaying spectrum, and
the relative output error against the dense layer."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..nn.low_rank_fit import relative_error
from .environment import DeviceLike, check_int, check_non_negative


def _random_orthonormal(rows: int, cols: int, generator: torch.Generator, device: Optional[DeviceLike]) -> Tensor:
    """``(rows, cols)`` float64 with orthonormal columns, Haar-distributed: the QR (on
    ``device``) of a Gaussian drawn on the CPU from ``generator``."""
    gaussian = torch.randn(rows, cols, generator=generator, dtype=torch.float64).to(device)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)


def structured_weight(
    out_features: int,
    in_features: int,
    *,
    decay: float = 1.0,
    seed: int = 0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[DeviceLike] = None,
) -> Tensor:
    """A trained-like dense weight ``(out_features, in_features)``: ``Q1 · diag(σ) · Q2ᵀ``
    with random orthonormal ``Q1``, ``Q2`` and singular values ``σ_i ∝ i^-decay``.

    It is scaled to the Frobenius norm ``nn.Linear``'s init has on average
    (``‖W‖_F² = out_features / 3``), so outputs have the usual magnitude. The Gaussians
    are drawn on the CPU from ``seed`` (the same weight on every device), factored and
    multiplied in float64 on ``device``, then cast to ``dtype``.
    """
    check_int("out_features", out_features, 1)
    check_int("in_features", in_features, 1)
    check_non_negative("decay", decay)
    rank = min(out_features, in_features)
    generator = torch.Generator().manual_seed(int(seed))
    left = _random_orthonormal(out_features, rank, generator, device)
    right = _random_orthonormal(in_features, rank, generator, device)
    sigma = torch.arange(1, rank + 1, dtype=torch.float64, device=left.device).pow(-float(decay))
    sigma *= math.sqrt(out_features / 3.0) / sigma.norm()
    weight = (left * sigma) @ right.t()
    return weight.to(dtype=dtype or torch.get_default_dtype(), device=device)


@torch.no_grad()
def relative_output_error(approx: Callable[[Tensor], Tensor], exact: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """``‖approx(x) − exact(x)‖_F / ‖exact(x)‖_F``, computed in float64."""
    return relative_error(approx(x), exact(x))
