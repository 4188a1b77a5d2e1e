"""Optimal low-rank fits of a dense weight in the factored forms the layers store.

Both layers represent a weight ``W`` (out × fan_in) through a fixed output-side basis:
the best rank-``r`` fit of ``W`` is ``Q Qᵀ W`` with ``Q`` (out × r) the top left singular
vectors of ``W``. With calibration activations ``X`` (Gram ``G = XᵀX``, fan_in × fan_in)
the best fit of the layer's *outputs* ``X Wᵀ`` is ``Q Qᵀ W`` with ``Q`` the top left
singular vectors of ``W C`` where ``C Cᵀ = G`` (activation-aware, whitened SVD).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["decomposition_dtype", "output_subspace", "sketch_factors_from_weight", "relative_error"]

_FLOAT64_MAX_NUMEL = 1 << 22
_EIGH_MIN_ROWS = 512


def decomposition_dtype(weight: Tensor) -> torch.dtype:
    """float64 for weights up to 4M entries, float32 beyond (whatever the model dtype)."""
    return torch.float64 if weight.numel() <= _FLOAT64_MAX_NUMEL else torch.float32


def _gram_square_root(gram: Tensor, damping: float) -> Tensor:
    """``C`` with ``C Cᵀ = G + λ·mean(diag G)·I`` (symmetric square root via eigh)."""
    gram = 0.5 * (gram + gram.t())
    ridge = damping * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny)
    eigvals, eigvecs = torch.linalg.eigh(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
    return (eigvecs * eigvals.clamp_min(0).sqrt()) @ eigvecs.t()


def _left_singular_vectors(target: Tensor) -> Tensor:
    """Left singular vectors of ``target`` (rows × cols), by decreasing singular value.

    Wide matrices with more than ``_EIGH_MIN_ROWS`` rows use the eigenvectors of
    ``target targetᵀ`` (a symmetric eigensolver on rows × rows is about twice as fast as
    the SVD there). Forming the Gram squares the condition number: in float64 the result
    matches the SVD to rounding; in float32 (weights over 4M entries) directions with
    singular values below ~√eps·σ₁ ≈ 3e-4·σ₁ blur together, which costs a truncation at
    most that much relative output error.
    """
    rows, cols = target.shape
    if _EIGH_MIN_ROWS < rows <= cols:
        _, eigvecs = torch.linalg.eigh(target @ target.t())
        return eigvecs.flip(1)
    left, _, _ = torch.linalg.svd(target, full_matrices=False)
    return left


def output_subspace(weight: Tensor, rank: int, gram: Optional[Tensor] = None, damping: float = 1e-4) -> Tensor:
    """Orthonormal basis ``Q`` (out × rank) of the best rank-``rank`` output subspace.

    Args:
        weight: ``(out, fan_in)`` in a decomposition dtype (see :func:`decomposition_dtype`).
        rank: number of columns wanted. Columns beyond ``min(out, fan_in)`` are zero.
        gram: optional ``(fan_in, fan_in)`` Gram matrix of calibration inputs.
        damping: ridge added to ``gram``, relative to its mean diagonal.
    """
    target = weight if gram is None else weight @ _gram_square_root(gram.to(weight.dtype), damping)
    left = _left_singular_vectors(target)
    available = min(rank, left.shape[1])
    basis = weight.new_zeros(weight.shape[0], rank)
    basis[:, :available] = left[:, :available]
    return basis


def _orthonormal_columns(matrix: Tensor, columns: int) -> Tensor:
    """Orthonormal basis (rows × columns) of a space containing ``matrix``'s columns."""
    q, _ = torch.linalg.qr(matrix, mode="reduced")
    out = matrix.new_zeros(matrix.shape[0], columns)
    out[:, : q.shape[1]] = q[:, :columns]
    return out


def sketch_factors_from_weight(
    weight: Tensor, num_terms: int, low_rank: int, gram: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(S1, U1, U2, S2)`` whose SKLinear form is the best rank-``2Lk`` fit of ``weight``.

    Args:
        weight: ``(out, in)`` (the ``nn.Linear`` layout), in the decomposition dtype.
        gram: optional ``(in, in)`` Gram of calibration inputs (output-optimal fit).

    Returns:
        ``S1`` (in × Lk), ``U1`` (Lk × out), ``U2`` (in × Lk), ``S2`` (Lk × out) with
        ``1/(2L)·(S1 U1 + U2 S2) = (Q Qᵀ W)ᵀ`` for the basis ``Q`` of :func:`output_subspace`.
    """
    rank = num_terms * low_rank
    two_l = 2.0 * num_terms
    basis = output_subspace(weight, 2 * rank, gram)
    first, second = basis[:, :rank], basis[:, rank:]
    weight_t = weight.t()
    U1 = first.t().contiguous()
    S1 = two_l * (weight_t @ first)
    projected = weight_t @ second
    U2 = _orthonormal_columns(projected, rank)
    S2 = two_l * ((U2.t() @ projected) @ second.t())
    return S1, U1, U2, S2


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """``‖approx − exact‖_F / ‖exact‖_F`` in float64 (0 when both are zero)."""
    diff = (approx.double() - exact.double()).norm()
    denom = exact.double().norm()
    if denom == 0:
        return float(diff)
    return float(diff / denom)
