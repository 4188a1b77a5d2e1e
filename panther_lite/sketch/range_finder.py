"""Randomized range finder with subspace (power) iteration: the dominant left singular
vectors of ``A K^{1/2}`` (the top eigenvectors of ``M = A K Aᵀ``) from products with ``A``,
``Aᵀ`` and ``K`` alone (Halko, Martinsson and Tropp, "Finding structure with randomness",
SIAM Review 2011, Algorithms 4.4 and 5.1)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["randomized_top_eigenvectors"]


def _lu_basis(matrix: Tensor) -> Tensor:
    """``P·L`` of ``matrix = P L U`` (rows × cols): a well-conditioned basis of its range,
    at a fraction of a QR's cost (the normaliser between power iterations)."""
    factors, pivots, _ = torch.linalg.lu_factor_ex(matrix)  # a singular matrix still has its P·L
    rows, cols = matrix.shape
    lower = factors.tril(-1)
    lower.diagonal().fill_(1)
    order = list(range(rows))  # LAPACK's sequential row swaps as one permutation
    for i, pivot in enumerate(pivots.tolist()):
        order[i], order[pivot - 1] = order[pivot - 1], order[i]
    basis = torch.empty_like(lower)
    basis[torch.tensor(order, device=matrix.device)] = lower
    return basis


def randomized_top_eigenvectors(
    factor: Tensor,
    start: Tensor,
    rank: int,
    power_iterations: int,
    kernel: Optional[Callable[[Tensor], Tensor]] = None,
) -> Tensor:
    """Approximate top-``rank`` eigenvectors of ``M = A K Aᵀ`` (``n × n``), by decreasing eigenvalue.

    Subspace iteration from ``start``: ``power_iterations`` times ``Q ← M·Q``, normalised
    by an LU factorisation in between and a QR at the end; then the Rayleigh–Ritz step
    ``Qᵀ M Q = (AᵀQ)ᵀ K (AᵀQ) = V Λ Vᵀ`` (eigendecomposition in float64) rotates ``Q`` onto
    its best ``rank`` directions. With ``start = A·K·Ω`` (or ``A·Ω``) for a random ``Ω`` of
    ``w`` columns, the error decays like ``(σ_{w+1}/σ_rank)^(2q+1)`` in the singular values
    of ``A K^{1/2}``. Cost: ``2q + 1`` products with ``A`` or ``Aᵀ`` (and ``q + 1`` with ``K``).

    Args:
        factor: ``A`` (``n × m``).
        start: ``(n, w)`` sample of ``M``'s range, ``rank <= w <= n``.
        rank: number of eigenvectors returned.
        power_iterations: ``q >= 0``.
        kernel: ``Z (m, w) -> K·Z`` for a positive semi-definite ``K``; None for ``K = I``.

    Returns:
        ``(n, rank)`` with orthonormal columns, in ``start``'s dtype.
    """
    if not 1 <= rank <= start.shape[1] <= start.shape[0]:
        raise ValueError(f"need 1 <= rank <= start columns <= start rows, got rank={rank} and start {tuple(start.shape)}")
    apply_kernel = kernel if kernel is not None else (lambda z: z)
    basis = start
    for _ in range(power_iterations):
        basis = factor @ apply_kernel(factor.t() @ _lu_basis(basis))
    basis = torch.linalg.qr(basis).Q
    half = factor.t() @ basis
    projected = (half.t() @ apply_kernel(half)).double()
    _, eigvecs = torch.linalg.eigh(0.5 * (projected + projected.t()))
    return basis @ eigvecs[:, -rank:].flip(1).to(basis.dtype)
