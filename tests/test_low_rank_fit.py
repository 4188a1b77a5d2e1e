"""Optimal low-rank fits: both eigensolver paths give the same best subspace."""
import pytest
import torch

from panther_lite.nn import low_rank_fit


@pytest.mark.parametrize("shape", [(40, 90), (90, 40), (64, 64)])
@pytest.mark.parametrize("with_gram", [False, True])
def test_gram_eigh_path_equals_svd_path(monkeypatch, shape, with_gram):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x = torch.randn(200, shape[1], generator=gen, dtype=torch.float64)
    gram = x.t() @ x if with_gram else None
    monkeypatch.setattr(low_rank_fit, "_EIGH_MIN_ROWS", 0)
    fast = low_rank_fit.output_subspace(weight, 12, gram)
    monkeypatch.setattr(low_rank_fit, "_EIGH_MIN_ROWS", 10**9)
    reference = low_rank_fit.output_subspace(weight, 12, gram)
    torch.testing.assert_close(fast @ fast.t(), reference @ reference.t(), rtol=0, atol=1e-10)
    torch.testing.assert_close(fast.t() @ fast, torch.eye(12, dtype=torch.float64), rtol=0, atol=1e-12)


def test_rank_beyond_the_matrix_pads_with_zero_columns():
    weight = torch.randn(5, 8, dtype=torch.float64)
    basis = low_rank_fit.output_subspace(weight, 7)
    assert basis.shape == (5, 7)
    torch.testing.assert_close(basis[:, :5] @ basis[:, :5].t(), torch.eye(5, dtype=torch.float64))
    assert torch.count_nonzero(basis[:, 5:]) == 0


def test_relative_error():
    exact = torch.tensor([3.0, 4.0])
    assert low_rank_fit.relative_error(exact, exact) == 0
    assert low_rank_fit.relative_error(torch.zeros(2), exact) == pytest.approx(1.0)
    assert low_rank_fit.relative_error(torch.ones(2), torch.zeros(2)) == pytest.approx(2**0.5)
