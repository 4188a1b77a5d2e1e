"""Ledoit–Wolf shrinkage of calibration Grams towards their diagonal
(panther_lite.conversion.calibration.shrinkage) and where convert applies it."""
import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.calibration.shrinkage import RowMoments, shrink, shrinkage_intensity
from panther_lite.conversion.kinds.linear import cluster_size


def correlated_rows(rows, width=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mix = torch.eye(width, dtype=torch.float64) + 0.3 * torch.randn(width, width, dtype=torch.float64, generator=generator)
    return torch.randn(rows, width, dtype=torch.float64, generator=generator) @ mix


def intensity_of(x, batches=1):
    moments = RowMoments()
    for chunk in x.chunk(batches):
        moments.add(chunk)
    return shrinkage_intensity(x.t() @ x, moments), moments


def reference_intensity(x):
    """Σ_{j≠k} Var(S_jk) / Σ_{j≠k} S_jk² from the per-row products directly (S = XᵀX/n)."""
    n = x.shape[0]
    products = x[:, :, None] * x[:, None, :]  # (n, d, d): x_i x_iᵀ
    sample = products.mean(0)
    off = ~torch.eye(x.shape[1], dtype=torch.bool)
    variance = ((products - sample).square().mean(0) / n)[off].sum()
    return float((variance / sample[off].square().sum()).clamp(0, 1))


def test_intensity_matches_the_ledoit_wolf_formula_and_batching_does_not_matter():
    x = correlated_rows(200)
    alpha, moments = intensity_of(x, batches=3)
    assert moments.rows == 200
    assert alpha == pytest.approx(reference_intensity(x), rel=1e-10)
    assert alpha == pytest.approx(intensity_of(x)[0], rel=1e-12)


def test_clustered_rows_use_the_cluster_robust_variance():
    x = correlated_rows(120)
    clusters = x.reshape(12, 10, 32)
    moments = RowMoments()
    for chunk in clusters.split(5):
        moments.add(chunk.reshape(-1, 32), cluster_size=10)
    assert (moments.rows, moments.cluster_rows_squared) == (120, 12 * 100)
    # Σ_c ‖offdiag(G_c − n_c S)‖² / n² over Σ_{j≠k} S_jk², straight from the clusters' Grams
    n, sample = 120, x.t() @ x / 120
    off = ~torch.eye(32, dtype=torch.bool)
    variance = sum(((c.t() @ c - 10 * sample)[off]).square().sum() for c in clusters) / n**2
    expected = float((variance / sample[off].square().sum()).clamp(0, 1))
    assert shrinkage_intensity(x.t() @ x, moments) == pytest.approx(expected, rel=1e-10)
    # identical rows within a cluster carry one row's information: more shrinkage than as single rows
    repeated = correlated_rows(12).repeat_interleave(10, dim=0)
    single, clustered = RowMoments(), RowMoments()
    single.add(repeated)
    clustered.add(repeated, cluster_size=10)
    gram = repeated.t() @ repeated
    assert shrinkage_intensity(gram, clustered) > 2 * shrinkage_intensity(gram, single)


def test_a_sequence_is_one_cluster():
    assert cluster_size(torch.zeros(4, 7, 16)) == 7 and cluster_size(torch.zeros(4, 16)) == 1


def test_intensity_falls_as_rows_accumulate():
    x = correlated_rows(20000)
    alphas = [intensity_of(x[:rows])[0] for rows in (16, 128, 1024, 20000)]
    assert alphas == sorted(alphas, reverse=True)
    assert alphas[0] > 0.5 and alphas[-1] < 0.01


def test_nothing_off_the_diagonal_means_no_shrinkage():
    x = torch.zeros(10, 4, dtype=torch.float64)
    x[:, 0] = torch.arange(10.0)
    assert intensity_of(x)[0] == 0.0
    assert shrinkage_intensity(torch.zeros(4, 4, dtype=torch.float64), RowMoments()) == 0.0


def test_shrink_keeps_the_diagonal_and_scales_the_rest():
    gram = correlated_rows(50, width=6).t().contiguous()
    gram = gram @ gram.t()
    shrunk = shrink(gram, 0.25)
    torch.testing.assert_close(shrunk, 0.75 * gram + 0.25 * torch.diag(gram.diagonal()), rtol=1e-14, atol=0)
    assert shrink(gram, 0.0).equal(gram)


@pytest.mark.parametrize("sequential", [False, True])
def test_the_report_says_when_a_layer_saw_fewer_rows_than_inputs(sequential):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16, dtype=torch.float64), nn.Tanh(), nn.Linear(16, 8, dtype=torch.float64))
    x = correlated_rows(40, width=64)  # 40 rows: fewer than the first layer's 64 inputs, more than the second's 16
    data = [x[:20], x[20:]]
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=data, sequential=sequential, progress=False)
    assert list(report["status"]) == ["converted", "converted"]
    assert report.loc[0, "reason"].startswith("calibrated on 40 rows, fewer than its 64 inputs: correlations shrunk by")
    assert not report.loc[1, "reason"]


def test_the_fit_whitens_by_the_shrunk_gram():
    torch.manual_seed(0)
    layer = nn.Linear(32, 24, dtype=torch.float64)
    x = correlated_rows(48)
    model = nn.Sequential(layer)
    dense_weight = layer.weight.detach().clone()
    panther_lite.convert(model, num_terms=1, low_rank=3, calibration_data=[x], progress=False)
    alpha, _ = intensity_of(x)
    gram = shrink(x.t() @ x, alpha)
    eigvals, eigvecs = torch.linalg.eigh(gram + 1e-4 * gram.diagonal().mean() * torch.eye(32, dtype=torch.float64))
    root = (eigvecs * eigvals.sqrt()) @ eigvecs.t()
    basis = torch.linalg.svd(dense_weight @ root).U[:, :6]
    expected = basis @ basis.t() @ dense_weight
    torch.testing.assert_close(model[0].effective_weight().detach(), expected, rtol=1e-8, atol=1e-10)
