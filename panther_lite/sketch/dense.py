"""Dense random sketching matrices: Gaussian and scaled sign (Rademacher)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .random import resolve_generator

__all__ = ["gaussian_matrix", "random_signs", "sign_matrix"]


def gaussian_matrix(
    m: int,
    n: int,
    *,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    dtype: Optional[torch.dtype] = None,
    device=None,
) -> Tensor:
    """``(m, n)`` matrix of i.i.d. N(0, 1/m) entries, so ``E[SᵀS] = I_n``."""
    gen = resolve_generator(seed, generator)
    out = torch.randn(m, n, generator=gen, dtype=torch.float64) / m**0.5
    return out.to(dtype=dtype or torch.get_default_dtype(), device=device)


def random_signs(
    size: Sequence[int],
    *,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    dtype: Optional[torch.dtype] = None,
    device=None,
) -> Tensor:
    """Tensor of shape ``size`` with i.i.d. uniform ±1 entries (Rademacher), drawn on the CPU."""
    gen = resolve_generator(seed, generator)
    signs = torch.randint(0, 2, tuple(size), generator=gen, dtype=torch.int8).mul_(2).sub_(1)
    return signs.to(dtype=dtype or torch.get_default_dtype(), device=device)


def sign_matrix(
    m: int,
    n: int,
    *,
    seed: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    dtype: Optional[torch.dtype] = None,
    device=None,
) -> Tensor:
    """``(m, n)`` matrix of i.i.d. ±1/√m entries, so ``E[SᵀS] = I_n``."""
    signs = random_signs((m, n), seed=seed, generator=generator, dtype=torch.float64)
    return (signs / m**0.5).to(dtype=dtype or torch.get_default_dtype(), device=device)
