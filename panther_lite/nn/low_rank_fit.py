"""Optimal low-rank fits of a dense weight in the factored forms the layers store.

Both layers represent a weight ``W`` (out × fan_in) through a fixed output-side basis:
the best rank-``r`` fit of ``W`` is ``Q Qᵀ W`` with ``Q`` (out × r) the top left singular
vectors of ``W``. With calibration activations ``X`` (Gram ``G = XᵀX``, fan_in × fan_in)
the best fit of the layer's *outputs* ``X Wᵀ`` is ``Q Qᵀ W`` with ``Q`` the top left
singular vectors of ``W C`` where ``C Cᵀ = G`` (activation-aware, whitened SVD).

Two ways to find ``Q`` (``method=``): ``"exact"`` — a full symmetric eigendecomposition or
SVD (and, with a Gram, the eigendecomposition of ``G`` for ``C``); ``"randomized"`` — a
randomized range finder with power iterations on ``M = W G Wᵀ`` (or ``W Wᵀ``), which needs
only products with ``W``, ``G`` and ``Wᵀ`` (no square root of ``G``); ``"auto"`` picks the
randomized one for large layers (:func:`uses_randomized_fit`).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..sketch.dense import gaussian_matrix
from ..sketch.random import check_seed
from ..sketch.range_finder import randomized_top_eigenvectors

__all__ = [
    "FIT_METHODS",
    "RANDOMIZED_MIN_SIZE",
    "decomposition_dtype",
    "gram_dtype",
    "damped_metric_root",
    "metric_basis",
    "metric_times",
    "output_metric_roots",
    "output_subspace",
    "sketch_factors_from_weight",
    "relative_error",
    "row_slices",
    "uses_randomized_fit",
]

FIT_METHODS = ("auto", "exact", "randomized")
_FLOAT64_MAX_NUMEL = 1 << 22
_EIGH_MIN_ROWS = 512
# method="auto" takes the randomized path from this size on (the smaller side of the weight,
# or with a calibration Gram also fan_in, whose eigendecomposition the exact path needs),
# while the sketch is at most half the smaller side. Measured with benchmarks/bench_fit.py
# (one thread of this 2-core CPU, rank n/8, decay 0.5): the randomized fit is 2-5x faster
# than the exact one from n = 512 on (0.03 s vs 0.14 s at 512, 0.24 s vs 0.51 s at 1024,
# 3.2 s vs 9.7 s at 2048, 4.4 s vs 22.9 s at 4096, rank 512) at 1.001-1.003x the optimal
# error. Below 1024 the exact fit takes well under a second, so it stays exact there.
RANDOMIZED_MIN_SIZE = 1024
# Sketch width rank + max(32, rank/4) and 3 power iterations: within 1.005x of the optimal
# error on power-law spectra (decay 0.3 to 1) at 1024-4096, rank 1/8 of the size.
_MIN_OVERSAMPLE = 32
_POWER_ITERATIONS = 3


def decomposition_dtype(weight: Tensor) -> torch.dtype:
    """float64 for weights up to 4M entries, float32 beyond (whatever the model dtype)."""
    return torch.float64 if weight.numel() <= _FLOAT64_MAX_NUMEL else torch.float32


def gram_dtype(fan_in: int) -> torch.dtype:
    """The dtype a calibration Gram of ``fan_in`` inputs is accumulated in: float64 up to 4M
    entries (``fan_in`` ≤ 2048), float32 beyond, half the memory (0.48 GB instead of 0.97 GB
    for an 11008-wide FFN input). Any weight that wide has over 4M entries unless it has
    fewer than 2048 outputs, and is fitted in float32 anyway (:func:`decomposition_dtype`);
    float32's rounding (~1e-7 relative) is far below what a calibration sample determines."""
    return torch.float64 if fan_in * fan_in <= _FLOAT64_MAX_NUMEL else torch.float32


def _gram_square_root(gram: Tensor, damping: float) -> Tensor:
    """``C`` with ``C Cᵀ = G + λ·mean(diag G)·I`` (symmetric square root via eigh, which reads
    the lower triangle: ``G`` symmetric up to rounding is all it needs)."""
    ridge = damping * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny)
    eigvals, eigvecs = torch.linalg.eigh(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
    return (eigvecs * eigvals.clamp_min(0).sqrt()) @ eigvecs.t()


OUTPUT_DAMPING = 1e-2
"""Ridge added to an output metric ``F``, relative to its mean diagonal: the channels the
calibration tokens barely reach keep a weight (measured on SmolLM2-135M, docs/evaluation.rst)."""


def output_metric_roots(output_gram: Tensor, out_features: int, damping: float = OUTPUT_DAMPING) -> Tuple[Tensor, Tensor]:
    """``(R, R⁻¹)`` with ``R = F^{1/2}`` for the output metric ``F`` (``(out, out)``, symmetric
    positive semi-definite, or its diagonal ``(out,)``) plus ``damping`` times its mean diagonal,
    scaled so that ``R``'s largest entry (diagonal) or eigenvalue (full) is 1: ``R W`` is never
    larger than ``W``, so the layer's activations keep the dense layer's scale. Diagonal metrics
    give vectors (``R`` scales rows), full ones matrices.

    Raises ValueError naming ``output_gram`` for a wrong shape, a non-finite entry or a metric
    without a positive diagonal."""
    values, vectors, _ = _damped_metric(output_gram, out_features, damping)
    roots = values.sqrt()
    roots = roots / roots.max()
    return _from_eigen(roots, vectors), _from_eigen(1.0 / roots, vectors)


def damped_metric_root(output_gram: Tensor, out_features: int, damping: float = OUTPUT_DAMPING) -> Tensor:
    """``(F + λ·mean(diag F)·I)^{1/2}`` at ``F``'s own scale (``λ = damping``, as the fits damp
    it): ``‖R (W − Ŵ) C‖²`` is then the error in ``F``'s units, comparable between layers whose
    metrics were summed over the same tokens. Shapes and errors as :func:`output_metric_roots`."""
    values, vectors, mean = _damped_metric(output_gram, out_features, damping)
    return _from_eigen((values * mean).sqrt(), vectors)


def _damped_metric(output_gram: Tensor, out_features: int, damping: float) -> Tuple[Tensor, Optional[Tensor], float]:
    """``(eigenvalues, eigenvectors, m)`` of ``F/m + damping·I`` (``m``: the mean diagonal of
    ``F``; eigenvectors None for a diagonal metric, whose eigenvalues are its entries), the
    metric checked as :func:`output_metric_roots` says."""
    if output_gram.shape not in ((out_features,), (out_features, out_features)):
        raise ValueError(
            f"output_gram: expected shape ({out_features},) or ({out_features}, {out_features}), got "
            f"{tuple(output_gram.shape)}"
        )
    if not bool(torch.isfinite(output_gram).all()):
        raise ValueError("output_gram: has NaN or infinite entries")
    diagonal = output_gram if output_gram.dim() == 1 else output_gram.diagonal()
    mean = float(diagonal.mean())
    if not mean > 0 or bool((diagonal < 0).any()):
        raise ValueError("output_gram: expected a positive semi-definite metric with a positive mean diagonal")
    if output_gram.dim() == 1:
        return output_gram / mean + damping, None, mean
    eye = torch.eye(out_features, dtype=output_gram.dtype, device=output_gram.device)
    eigvals, eigvecs = torch.linalg.eigh(0.5 * (output_gram + output_gram.t()) / mean + damping * eye)
    return eigvals.clamp_min(damping), eigvecs, mean


def _from_eigen(values: Tensor, vectors: Optional[Tensor]) -> Tensor:
    """The vector ``values`` (no ``vectors``: a diagonal), else ``V·diag(values)·Vᵀ``."""
    return values if vectors is None else (vectors * values) @ vectors.t()


def metric_times(root: Optional[Tensor], matrix: Tensor) -> Tensor:
    """``R · matrix`` for a metric root from :func:`output_metric_roots` (None: ``matrix``)."""
    if root is None:
        return matrix
    return root[:, None] * matrix if root.dim() == 1 else root @ matrix


def metric_basis(inverse: Optional[Tensor], basis: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``(P, T)`` with ``R⁻¹·basis = P·T`` (``P``: orthonormal columns, ``T`` square; ``inverse``:
    ``R⁻¹`` from :func:`output_metric_roots`), or ``(basis, None)`` without a metric. A fit's
    fixed output factor takes ``P`` and its trained factor ``T``: ``R⁻¹`` reaches 100× and more
    on a model's Fisher, and a step on the trained factor behind a fixed ``R⁻¹·basis`` would reach
    the weight amplified that much (fine-tuning lost what the fit had won)."""
    if inverse is None:
        return basis, None
    return torch.linalg.qr(metric_times(inverse, basis))


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


def _sketch_width(rank: int) -> int:
    return rank + max(_MIN_OVERSAMPLE, rank // 4)


def uses_randomized_fit(shape: Sequence[int], rank: int, method: str = "auto", with_gram: bool = False) -> bool:
    """Whether a fit of a ``shape = (out, fan_in)`` weight at ``rank`` columns takes the
    randomized path: never for ``"exact"``, nor when the sketch would not be smaller than
    the matrix (the exact path is then as cheap); for ``"auto"`` only from
    ``RANDOMIZED_MIN_SIZE`` on (the smaller side, or ``fan_in`` too ``with_gram``) and while
    the sketch is at most half the smaller side."""
    if method not in FIT_METHODS:
        raise ValueError(f"method must be one of {FIT_METHODS}, got {method!r}")
    smaller, width = min(shape), _sketch_width(rank)
    if method == "exact" or width >= smaller:
        return False
    size = max(smaller, shape[1]) if with_gram else smaller
    return method == "randomized" or (size >= RANDOMIZED_MIN_SIZE and 2 * width <= smaller)


def _randomized_output_subspace(weight: Tensor, rank: int, gram: Optional[Tensor], damping: float, seed: int) -> Tensor:
    """Top-``rank`` left singular vectors of ``W C`` (or ``W``) as the eigenvectors of
    ``M = W (G + ridge) Wᵀ`` (or ``W Wᵀ``), by a seeded randomized range finder."""
    omega = gaussian_matrix(weight.shape[1], _sketch_width(rank), seed=seed, dtype=weight.dtype, device=weight.device)
    if gram is None:
        return randomized_top_eigenvectors(weight, weight @ omega, rank, _POWER_ITERATIONS)
    ridge = float(damping * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny))

    def whitened(z: Tensor) -> Tensor:  # (G + ridge·I)·z
        return torch.addmm(z, gram, z, beta=ridge)

    return randomized_top_eigenvectors(weight, weight @ whitened(omega), rank, _POWER_ITERATIONS, whitened)


def output_subspace(
    weight: Tensor,
    rank: int,
    gram: Optional[Tensor] = None,
    damping: float = 1e-4,
    *,
    method: str = "auto",
    seed: Optional[int] = None,
) -> Tensor:
    """Orthonormal basis ``Q`` (out × rank) of the best rank-``rank`` output subspace.

    Args:
        weight: ``(out, fan_in)`` in a decomposition dtype (see :func:`decomposition_dtype`).
        rank: number of columns wanted. Columns beyond ``min(out, fan_in)`` are zero.
        gram: optional ``(fan_in, fan_in)`` Gram matrix of calibration inputs.
        damping: ridge added to ``gram``, relative to its mean diagonal.
        method: ``"exact"`` (full eigendecomposition), ``"randomized"`` (range finder with
            power iterations, within about 1% of the optimal error on trained-like
            spectra) or ``"auto"`` (see :func:`uses_randomized_fit`).
        seed: the randomized path's seed (None means 0: fits are deterministic).
    """
    seed = check_seed(seed)
    if uses_randomized_fit(weight.shape, rank, method, with_gram=gram is not None):
        gram = None if gram is None else gram.to(weight.dtype)
        return _randomized_output_subspace(weight, rank, gram, damping, 0 if seed is None else seed)
    available = min(rank, *weight.shape)
    if gram is not None and weight.shape[0] <= weight.shape[1]:
        left = _wide_whitened_left_singular_vectors(weight, gram.to(weight.dtype), damping)
    else:
        root = None if gram is None else _gram_square_root(gram.to(weight.dtype), damping)
        if weight.shape[0] > weight.shape[1] > _EIGH_MIN_ROWS:
            left = _tall_left_singular_vectors(weight, root, available)
        else:
            left = _left_singular_vectors(weight if root is None else weight @ root)
    basis = weight.new_zeros(weight.shape[0], rank)
    basis[:, :available] = left[:, :available]
    return basis


def _wide_whitened_left_singular_vectors(weight: Tensor, gram: Tensor, damping: float) -> Tensor:
    """Left singular vectors of ``W C`` (``C Cᵀ = G + ridge·I``) for ``W`` with out ≤ fan_in:
    the eigenvectors of ``W (G + ridge·I) Wᵀ`` (out × out), by decreasing eigenvalue. No
    square root of ``G`` (an eigendecomposition on the wider fan_in side) is needed; the
    squared condition number costs nothing in float64, in which the product is summed
    (:func:`_whitened_square`) whatever the weight's dtype."""
    ridge = float(damping * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny))
    return torch.linalg.eigh(_whitened_square(weight, gram, ridge))[1].flip(1).to(weight.dtype)


def _whitened_square(weight: Tensor, gram: Tensor, ridge: float, block: int = 1024) -> Tensor:
    """``W (G + ridge·I) Wᵀ`` (out × out, float64) summed a ``block × block`` tile of ``G`` at a
    time: no float64 copy of ``W`` or ``G``. Summed in float32, the rounding of the products
    (~1e-7 of the largest) swamps the directions whose whitened singular values are below
    ~3e-4·σ₁ (activation outliers make many such), which a fit of float32 weights keeps."""
    out, fan_in = weight.shape
    square = torch.zeros(out, out, dtype=torch.float64, device=weight.device)
    for start in range(0, fan_in, block):
        columns = weight[:, start : start + block].double()
        product = ridge * columns  # becomes the column block W (G + ridge·I)[:, block]
        for inner in range(0, fan_in, block):
            tile = gram[inner : inner + block, start : start + block].double()
            product.addmm_(weight[:, inner : inner + block].double(), tile)
        square.addmm_(product, columns.t())
    return square


def _tall_left_singular_vectors(weight: Tensor, root: Optional[Tensor], columns: int) -> Tensor:
    """The top ``columns`` left singular vectors of ``T = W C`` (``C = root``, or ``I``) for a
    tall ``W`` (out > fan_in), from the eigenvectors ``V`` of the small ``Tᵀ T = C WᵀW C``:
    ``T V_top = U_top Σ_top``, so a QR of ``W (C V_top)`` gives them by decreasing singular
    value (up to signs) without forming ``T`` or an SVD of out × fan_in (an ``lm_head``'s
    32000 × 2048 SVD took 0.9 GB of working memory). Same float32 caveat as
    :func:`_left_singular_vectors`."""
    inner = weight.t() @ weight
    if root is not None:
        inner = root @ inner @ root
    _, eigvecs = torch.linalg.eigh(inner)
    right = eigvecs[:, -columns:].flip(1)
    return torch.linalg.qr(weight @ (right if root is None else root @ right)).Q


def _orthonormal_columns(matrix: Tensor, columns: int) -> Tensor:
    """Orthonormal basis (rows × columns) of a space containing ``matrix``'s columns."""
    q, _ = torch.linalg.qr(matrix, mode="reduced")
    out = matrix.new_zeros(matrix.shape[0], columns)
    out[:, : q.shape[1]] = q[:, :columns]
    return out


def sketch_factors_from_weight(
    weight: Tensor,
    num_terms: int,
    low_rank: int,
    gram: Optional[Tensor] = None,
    *,
    output_gram: Optional[Tensor] = None,
    method: str = "auto",
    seed: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(S1, U1, U2, S2)`` whose SKLinear form is the best rank-``2Lk`` fit of ``weight``.

    Args:
        weight: ``(out, in)`` (the ``nn.Linear`` layout), in the decomposition dtype.
        gram: optional ``(in, in)`` Gram of calibration inputs (output-optimal fit).
        output_gram: optional metric ``F`` on the outputs, ``(out, out)`` or its diagonal
            ``(out,)`` (e.g. the Fisher information of the model's output at the layer's
            output): the fit then minimises ``tr(F (W−Ŵ) G (W−Ŵ)ᵀ)``, the Kronecker-factored
            second-order change of the model's output, instead of the layer's own output
            error (:func:`output_metric_roots` damps and scales it).
        method, seed: how the basis is found, as for :func:`output_subspace`.

    Returns:
        ``S1`` (in × Lk), ``U1`` (Lk × out), ``U2`` (in × Lk), ``S2`` (Lk × out) with
        ``1/(2L)·(S1 U1 + U2 S2) = (R⁻¹ Q Qᵀ R W)ᵀ`` for the basis ``Q`` of
        :func:`output_subspace` of ``R W`` (``R = F^{1/2}``, the identity without
        ``output_gram``). The fixed ``U1 = 2L·Pᵀ`` (``R⁻¹Q₁ = P T``, :func:`metric_basis`;
        ``P = Q₁``, ``T = I`` without ``output_gram``) has orthonormal rows times the factor
        ``2L``, so ``S1 = (RW)ᵀ Q₁ Tᵀ`` trains unamplified and the activations ``x·S1``
        have the norm of the first half's output (the dense layer's scale without a metric;
        no float16 overflow where the layer's own output has none);
        ``U2`` is orthonormal, so ``x·U2`` is no larger than ``x``, and ``S2`` carries ``2L``
        into the last GEMM, whose ``alpha`` removes it.

    Example:
        >>> w = torch.randn(6, 5, dtype=torch.float64)
        >>> S1, U1, U2, S2 = sketch_factors_from_weight(w, 1, 3, output_gram=torch.rand(6, dtype=torch.float64))
        >>> torch.allclose((S1 @ U1 + U2 @ S2) / 2, w.t())  # rank 6 >= 5: exact
        True
    """
    rank = num_terms * low_rank
    two_l = 2.0 * num_terms
    root, inverse = (None, None) if output_gram is None else output_metric_roots(output_gram.to(weight), weight.shape[0])
    target = metric_times(root, weight)
    basis = output_subspace(target, 2 * rank, gram, method=method, seed=seed)
    first, second = basis[:, :rank], basis[:, rank:]
    target_t = target.t()
    output_basis, triangle = metric_basis(inverse, first)
    U1 = (two_l * output_basis.t()).contiguous()
    S1 = target_t @ first if triangle is None else target_t @ first @ triangle.t()
    projected = target_t @ second
    U2 = _orthonormal_columns(projected, rank)
    S2 = two_l * ((U2.t() @ projected) @ metric_times(inverse, second).t())
    return S1, U1, U2, S2


def row_slices(rows: int, row_length: int) -> Iterator[slice]:
    """Slices of ``rows`` rows of ``row_length`` entries, each at most ~4M entries (32 MB in
    float64): float64 sums over a large weight (an ``lm_head``) never hold a float64 copy of it."""
    step = max(1, _FLOAT64_MAX_NUMEL // max(row_length, 1))
    return (slice(start, start + step) for start in range(0, rows, step))


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """``‖approx − exact‖_F / ‖exact‖_F`` of two tensors of one shape (any), in float64 a few
    rows (first-dimension slices) at a time; ``‖approx − exact‖_F`` when ``exact`` is zero."""
    if exact.numel() == 0:
        return 0.0
    exact = exact.reshape(exact.shape[0], -1) if exact.dim() > 1 else exact.reshape(1, -1)
    approx = approx.reshape_as(exact)
    squared_diff = squared_norm = exact.new_zeros((), dtype=torch.float64)
    for rows in row_slices(*exact.shape):
        chunk = exact[rows].double()
        squared_diff = squared_diff + (approx[rows].double() - chunk).square().sum()
        squared_norm = squared_norm + chunk.square().sum()
    if squared_norm == 0:
        return float(squared_diff.sqrt())
    return float((squared_diff / squared_norm).sqrt())
