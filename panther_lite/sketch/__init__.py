r"""Sketching operators ``S`` (``m × n``): Gaussian, scaled sign, SRHT, CountSketch and SJLT.

Every operator is scaled so that ``E[SᵀS] = I_n`` (so ``E‖Sx‖² = ‖x‖²``), draws its
randomness on the CPU from ``seed`` or a CPU ``torch.Generator`` (see
:func:`~panther_lite.sketch.resolve_generator`) and then moves to ``device``, so one seed
gives the same operator on every device. ``apply(x)`` sketches the last dimension of
``x``: ``(*, n) -> (*, m)``, and equals ``x @ S.to_dense().T``.

=================  ==================================  ==========================
kind               entries of ``S``                    ``apply`` cost per row
=================  ==================================  ==========================
``"gaussian"``     i.i.d. N(0, 1/m)                    ``O(mn)`` (GEMM)
``"sign"``         i.i.d. ±1/√m                        ``O(mn)`` (GEMM)
``"srht"``         ±1/√m: sampled rows of ``H D``      ``O(N log N)``, ``N = 2^⌈log2 n⌉``
``"countsketch"``  one ±1 per column                   ``O(n)``
``"sjlt"``         ``s`` entries ±1/√s per column      ``O(ns)``
=================  ==================================  ==========================

Build one by name with :func:`make_sketch` or from its class::

    >>> S = make_sketch("srht", 64, 1000, seed=0)          # == SRHTSketch(64, 1000, seed=0)
    >>> S(torch.randn(8, 1000)).shape                      # same as x @ S.to_dense().T
    torch.Size([8, 64])
"""
from .dense import gaussian_matrix, random_signs, sign_matrix
from .hadamard import fwht, hadamard_entries, next_power_of_two
from .operators import CountSketch, GaussianSketch, SignSketch, SJLTSketch, SketchOperator, SRHTSketch, make_sketch
from .random import resolve_generator

__all__ = [
    "SketchOperator",
    "GaussianSketch",
    "SignSketch",
    "SRHTSketch",
    "CountSketch",
    "SJLTSketch",
    "make_sketch",
    "fwht",
    "hadamard_entries",
    "next_power_of_two",
    "gaussian_matrix",
    "sign_matrix",
    "random_signs",
    "resolve_generator",
]
