"""Optimal low-rank fits: both eigensolver paths give the same best subspace; the
randomized fit is within 1% of the optimum, deterministic, and measured by bench_fit.py."""
import csv
import importlib.util

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


@pytest.mark.parametrize("method", ["exact", "randomized"])
@pytest.mark.parametrize("shape", [(30, 70), (70, 30)])
def test_fits_leave_the_gram_unchanged(method, shape):
    """A Gram symmetric only up to rounding (as ``XᵀX`` accumulated batch by batch is) is read,
    never symmetrised in place: the caller's tensor keeps its exact values."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x = torch.randn(100, shape[1], generator=gen, dtype=torch.float64)
    gram = x.t() @ x
    gram[0, 1] += 1e-12 * gram[0, 1].abs()
    before = gram.clone()
    low_rank_fit.sketch_factors_from_weight(weight, 2, 4, gram, method=method)
    assert torch.equal(gram, before)


@pytest.mark.parametrize("block", [1024, 16])
def test_float32_whitened_wide_fit_is_exact_under_activation_outliers(monkeypatch, block):
    """A float32 weight of rank 8, inputs with 1000x outlier channels: the exact whitened fit at
    rank 8 reproduces the outputs to 3e-8 (``W G Wᵀ`` summed in float32 left 5e-6 of them, the
    square-root path before it 9e-7), also when summed in tiles smaller than the Gram."""
    square = low_rank_fit._whitened_square
    monkeypatch.setattr(low_rank_fit, "_whitened_square", lambda w, g, r: square(w, g, r, block=block))
    gen = torch.Generator().manual_seed(1)
    left = torch.linalg.qr(torch.randn(60, 8, generator=gen, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(150, 8, generator=gen, dtype=torch.float64))[0]
    weight = (left @ right.t()).float()
    x = torch.randn(2000, 150, generator=gen, dtype=torch.float64)
    x[:, :4] *= 1e3
    basis = low_rank_fit.output_subspace(weight, 8, (x.t() @ x).float(), method="exact").double()
    outputs = x @ weight.double().t()
    assert low_rank_fit.relative_error(outputs @ basis @ basis.t(), outputs) < 1e-7


def test_gram_dtype_is_float64_up_to_4m_entries_and_float32_beyond():
    assert low_rank_fit.gram_dtype(2048) == torch.float64
    assert low_rank_fit.gram_dtype(2049) == torch.float32


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
    assert low_rank_fit.relative_error(torch.ones(0, 3), torch.ones(0, 3)) == 0


def test_errors_summed_in_row_slices_equal_the_whole_matrix_formulas(monkeypatch):
    """Slices of 7 rows (the limit lowered) give the same float64 errors as one pass."""
    from panther_lite.conversion.fitting.layer import output_error

    monkeypatch.setattr(low_rank_fit, "_FLOAT64_MAX_NUMEL", 7 * 30)
    assert [list(range(20))[s] for s in low_rank_fit.row_slices(20, 30)] == [
        list(range(0, 7)), list(range(7, 14)), list(range(14, 20))
    ]
    gen = torch.Generator().manual_seed(0)
    weight, approx = torch.randn(20, 30, generator=gen), torch.randn(20, 30, generator=gen)
    x = torch.randn(50, 30, generator=gen, dtype=torch.float64)
    w, a = weight.double(), approx.double()
    expected = float((w - a).norm() / w.norm())
    assert low_rank_fit.relative_error(approx, weight) == pytest.approx(expected, rel=1e-12)
    expected_output = float((x @ (w - a).t()).norm() / (x @ w.t()).norm())
    assert output_error(weight, approx, x.t() @ x) == pytest.approx(expected_output, rel=1e-10)


# --- randomized fits ------------------------------------------------------------------------------

def decaying_weight(out_f=160, in_f=200, decay=0.5, seed=0):
    """``P diag(σ) Qᵀ`` with orthonormal ``P``, ``Q`` and a power-law spectrum ``σ_j = j^-decay``."""
    gen = torch.Generator().manual_seed(seed)
    size = min(out_f, in_f)
    left, _ = torch.linalg.qr(torch.randn(out_f, size, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(in_f, size, generator=gen, dtype=torch.float64))
    sigma = torch.arange(1, size + 1, dtype=torch.float64) ** -decay
    return (left * sigma) @ right.t()


def fit_error(weight, basis, x=None):
    """Relative error of the fit ``Q Qᵀ W`` (of the outputs ``X Wᵀ`` when ``x`` is given)."""
    fit = basis @ (basis.t() @ weight)
    if x is None:
        return low_rank_fit.relative_error(fit, weight)
    return low_rank_fit.relative_error(x @ fit.t(), x @ weight.t())


@pytest.mark.parametrize("decay", [0.3, 1.0])
@pytest.mark.parametrize("with_gram", [False, True])
def test_randomized_fit_is_within_one_percent_of_exact(decay, with_gram):
    weight = decaying_weight(decay=decay)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(400, 200, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, 200, dtype=torch.float64)
    gram = x.t() @ x if with_gram else None
    exact = low_rank_fit.output_subspace(weight, 16, gram, method="exact")
    fast = low_rank_fit.output_subspace(weight, 16, gram, method="randomized")
    reference = x if with_gram else None
    assert fit_error(weight, fast, reference) <= 1.01 * fit_error(weight, exact, reference)
    torch.testing.assert_close(fast.t() @ fast, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)


def test_randomized_sketch_factors_fit_within_one_percent_of_exact():
    weight = decaying_weight(decay=0.5)
    effective = {}
    for method in ("exact", "randomized"):
        S1, U1, U2, S2 = low_rank_fit.sketch_factors_from_weight(weight, 2, 4, method=method)
        effective[method] = ((S1 @ U1 + U2 @ S2) / 4).t()
    optimal = low_rank_fit.relative_error(effective["exact"], weight)
    sigma = torch.linalg.svdvals(weight)
    torch.testing.assert_close(optimal, float(sigma[16:].norm() / sigma.norm()), rtol=1e-10, atol=0)
    assert low_rank_fit.relative_error(effective["randomized"], weight) <= 1.01 * optimal


def test_randomized_fit_of_rank_deficient_weights():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(60, 5, generator=gen, dtype=torch.float64) @ torch.randn(5, 80, generator=gen, dtype=torch.float64)
    for w in (weight, torch.zeros_like(weight)):  # singular sketches: the LU normaliser must not fail
        basis = low_rank_fit.output_subspace(w, 8, method="randomized")
        torch.testing.assert_close(basis.t() @ basis, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(basis @ (basis.t() @ w), w, rtol=0, atol=1e-12)


def test_randomized_fit_is_deterministic_given_a_seed():
    weight = decaying_weight()
    first = low_rank_fit.output_subspace(weight, 12, method="randomized", seed=3)
    assert torch.equal(first, low_rank_fit.output_subspace(weight, 12, method="randomized", seed=3))
    assert torch.equal(
        low_rank_fit.output_subspace(weight, 12, method="randomized"),
        low_rank_fit.output_subspace(weight, 12, method="randomized", seed=0),
    )
    assert not torch.equal(first, low_rank_fit.output_subspace(weight, 12, method="randomized", seed=4))


def test_auto_is_exact_below_the_threshold_and_randomized_above():
    weight = decaying_weight()
    assert torch.equal(low_rank_fit.output_subspace(weight, 12), low_rank_fit.output_subspace(weight, 12, method="exact"))
    size = low_rank_fit.RANDOMIZED_MIN_SIZE
    assert low_rank_fit.uses_randomized_fit((size, 2 * size), size // 8)
    assert not low_rank_fit.uses_randomized_fit((size - 1, 2 * size), size // 8)
    assert not low_rank_fit.uses_randomized_fit((size, size), size // 2)  # the sketch would be too wide
    assert not low_rank_fit.uses_randomized_fit((size, size), 8, "exact")
    assert not low_rank_fit.uses_randomized_fit((size // 2, 4 * size), 8)
    assert low_rank_fit.uses_randomized_fit((size // 2, 4 * size), 8, with_gram=True)  # the Gram is large
    assert low_rank_fit.uses_randomized_fit((100, 100), 8, "randomized")
    assert not low_rank_fit.uses_randomized_fit((100, 100), 90, "randomized")  # no smaller than the matrix


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match=r"method must be one of \('auto', 'exact', 'randomized'\), got 'svd'"):
        low_rank_fit.output_subspace(torch.eye(4, dtype=torch.float64), 2, method="svd")


def test_fixed_sketch_u1_carries_the_factor_2l():
    weight = decaying_weight(out_f=30, in_f=40)
    S1, U1, U2, S2 = low_rank_fit.sketch_factors_from_weight(weight, 3, 2)
    basis = U1.t() / 6  # orthonormal output basis
    torch.testing.assert_close(basis.t() @ basis, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(S1, weight.t() @ basis, rtol=0, atol=1e-12)  # the dense layer's scale
    torch.testing.assert_close(U2.t() @ U2, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-12)


def test_bench_fit_writes_its_csv_and_plot(tmp_path, repo_root):
    path = repo_root / "benchmarks" / "bench_fit.py"
    spec = importlib.util.spec_from_file_location("bench_fit", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_args([]).output_dir == repo_root / "benchmarks" / "out"
    assert bench.main(["--sizes", "96", "--rank", "8", "--gram", "--output-dir", str(tmp_path)]) == 0
    with open(tmp_path / "fit.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["gram"], r["method"]) for r in rows] == [
        (g, m) for g in ("False", "True") for m in ("svd", "exact", "randomized")
    ]
    for row in rows:
        assert float(row["median_s"]) > 0
        if row["method"] == "randomized":
            assert float(row["error_ratio"]) <= 1.01
    assert (tmp_path / "fit.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "64", "--rank", "64"])
