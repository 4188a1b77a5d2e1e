"""Randomized range finder: exact on low-rank operators, near-optimal on decaying spectra,
the same with a kernel ``K`` as with the factor ``A K^{1/2}``."""
import pytest
import torch

from panther_lite.sketch.range_finder import _lu_basis, randomized_top_eigenvectors


def factor_with_spectrum(singular_values: torch.Tensor, cols: int, seed: int = 0) -> torch.Tensor:
    """``A`` (n × cols) with the given singular values and random singular vectors."""
    gen = torch.Generator().manual_seed(seed)
    n = len(singular_values)
    left, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(cols, n, generator=gen, dtype=torch.float64))
    return (left * singular_values) @ right.t()


def gaussian(rows, cols, seed):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_lu_basis_spans_the_same_range_with_unit_lower_structure():
    matrix = gaussian(30, 6, 0)
    basis = _lu_basis(matrix)
    q, _ = torch.linalg.qr(basis)
    torch.testing.assert_close(q @ (q.t() @ matrix), matrix, rtol=0, atol=1e-12)
    assert torch.linalg.cond(basis) < 1e3


def test_recovers_the_exact_eigenspace_of_a_low_rank_operator():
    sigma = torch.cat([torch.arange(6, 0, -1, dtype=torch.float64), torch.zeros(34, dtype=torch.float64)])
    A = factor_with_spectrum(sigma, 50)
    Q = randomized_top_eigenvectors(A, A @ gaussian(50, 8, 1), 4, power_iterations=1)
    left, _, _ = torch.linalg.svd(A)
    torch.testing.assert_close(Q @ Q.t(), left[:, :4] @ left[:, :4].t(), rtol=0, atol=1e-10)
    torch.testing.assert_close(Q.t() @ Q, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
    captured = (Q.t() @ A).norm(dim=1)
    assert torch.all(captured[:-1] >= captured[1:])  # decreasing order


def test_power_iterations_approach_the_optimal_subspace():
    A = factor_with_spectrum(torch.arange(1, 201, dtype=torch.float64) ** -0.5, 240)
    start = A @ gaussian(240, 30, 2)
    optimal = torch.linalg.svdvals(A)[20:].norm()

    def residual(q: int) -> float:
        Q = randomized_top_eigenvectors(A, start, 20, power_iterations=q)
        return float((A - Q @ (Q.t() @ A)).norm())

    errors = [residual(q) for q in (0, 1, 3)]
    assert errors[0] > errors[1] > errors[2] >= optimal * (1 - 1e-12)
    assert errors[2] <= 1.01 * optimal


def test_kernel_acts_like_its_square_root_in_the_factor():
    A = factor_with_spectrum(torch.arange(1, 41, dtype=torch.float64) ** -1.0, 60)
    root = torch.diag(torch.linspace(0.2, 2.0, 60, dtype=torch.float64))
    omega = gaussian(60, 16, 3)
    with_kernel = randomized_top_eigenvectors(A, A @ (root @ (root @ omega)), 8, 2, kernel=lambda z: root @ (root @ z))
    whitened = A @ root
    with_factor = randomized_top_eigenvectors(whitened, whitened @ (root @ omega), 8, 2)
    torch.testing.assert_close(with_kernel @ with_kernel.t(), with_factor @ with_factor.t(), rtol=0, atol=1e-10)


def test_rejects_a_start_narrower_than_the_rank():
    with pytest.raises(ValueError, match="rank <= start columns"):
        randomized_top_eigenvectors(torch.eye(10), torch.randn(10, 3), 4, 1)
