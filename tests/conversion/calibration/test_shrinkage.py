"""Ledoit–Wolf shrinkage of calibration Grams towards their diagonal
(panther_lite.conversion.calibration.shrinkage) and where convert applies it."""
import copy

import pytest
import torch
import torch.nn as nn

import panther_lite
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.conversion.calibration.shrinkage import (
    AUTO_FRACTION, MULTIPLES, HeldBack, RowMoments, choose_strength, shrink, shrinkage_intensity,
)
from panther_lite.nn import SKLinear
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


def test_the_fit_whitens_by_the_gram_shrunk_by_a_fixed_strength():
    torch.manual_seed(0)
    layer = nn.Linear(32, 24, dtype=torch.float64)
    x = correlated_rows(48)
    model = nn.Sequential(layer)
    dense_weight = layer.weight.detach().clone()
    report = panther_lite.convert(model, num_terms=1, low_rank=3, calibration_data=[x], shrinkage=0.3, progress=False)
    assert report.loc[0, "shrinkage"] == 0.3 and report.loc[0, "calibration_rows"] == 48
    gram = shrink(x.t() @ x, 0.3)
    eigvals, eigvecs = torch.linalg.eigh(gram + 1e-4 * gram.diagonal().mean() * torch.eye(32, dtype=torch.float64))
    root = (eigvecs * eigvals.sqrt()) @ eigvecs.t()
    basis = torch.linalg.svd(dense_weight @ root).U[:, :6]
    expected = basis @ basis.t() @ dense_weight
    torch.testing.assert_close(model[0].effective_weight().detach(), expected, rtol=1e-8, atol=1e-10)


def test_shrinkage_zero_is_the_unshrunk_fit_bit_for_bit():
    torch.manual_seed(0)
    layer = nn.Linear(32, 24)
    x = correlated_rows(48).float()
    expected = SKLinear.from_linear(
        layer, 1, 3, init="svd", gram=torch.zeros(32, 32, dtype=torch.float64).addmm_(x.double().t(), x.double())
    )
    for off in (0, 0.0, None):
        model = nn.Sequential(copy.deepcopy(layer))
        report = panther_lite.convert(model, num_terms=1, low_rank=3, calibration_data=[x], shrinkage=off, progress=False)
        assert report.loc[0, "shrinkage"] == 0.0
        for name, tensor in expected.state_dict().items():
            assert torch.equal(model[0].state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "value, error, words",
    [(-0.1, ValueError, "[0, 1]"), (1.5, ValueError, "[0, 1]"), (float("nan"), ValueError, "nan"),
     ("sometimes", ValueError, "'sometimes'"), (True, TypeError, "bool"), ([0.1], TypeError, "list")],
)
def test_bad_shrinkage_values_are_named(value, error, words):
    with pytest.raises(error, match="shrinkage") as raised:
        panther_lite.ConvertConfig(param_ratio=0.5, shrinkage=value)
    assert words in str(raised.value)


def low_rank_plus_noise(seed, clusters, length, width, rank, noise):
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, width, dtype=torch.float64, generator=generator)
    x = torch.randn(clusters, length, rank, dtype=torch.float64, generator=generator) @ mix
    return x + noise * torch.randn(clusters, length, width, dtype=torch.float64, generator=generator)


def explicit_held_error(weight, rank, train_rows, test_rows, strength):
    """‖X_test (W − QQᵀW)ᵀ‖² from the rows themselves, Q the exact fit's basis on the train rows' shrunk Gram."""
    gram = shrink(train_rows.t() @ train_rows, strength)
    values, vectors = torch.linalg.eigh(gram + 1e-4 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype))
    basis = torch.linalg.svd(weight @ ((vectors * values.clamp_min(0).sqrt()) @ vectors.t())).U[:, :rank]
    return float((test_rows @ (weight - basis @ basis.t() @ weight).t()).square().sum())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6), clusters=st.integers(2, 12), length=st.integers(1, 6), shape=st.sampled_from([(8, 16), (20, 12)]),
    rank=st.integers(1, 6), noise=st.floats(0.01, 2.0),
)
def test_auto_strength_is_never_worse_than_none_on_held_back_rows(seed, clusters, length, shape, rank, noise):
    fan_out, fan_in = shape
    x = low_rank_plus_noise(seed, clusters, length, fan_in, 3, noise)
    rows = x.reshape(-1, fan_in)
    moments, held = RowMoments(), HeldBack.empty(fan_in, None)
    for chunk in x.split(5):  # several calls: the halves alternate across them
        moments.add(chunk.reshape(-1, fan_in), length)
        held.add(chunk.reshape(-1, fan_in), length)
    weight = torch.randn(fan_out, fan_in, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    chosen = choose_strength(weight, rank, rows.t() @ rows, moments, held)
    odd, even = x[1::2].reshape(-1, fan_in), x[0::2].reshape(-1, fan_in)  # the held half: every other sequence

    def held_error(multiple):
        alphas = [min(1.0, multiple * clustered_intensity(train, length)) for train in (odd, even)]  # a sequence: a cluster
        return explicit_held_error(weight, rank, even, odd, alphas[1]) + explicit_held_error(weight, rank, odd, even, alphas[0])

    grid = {m: e for m, e in chosen.held_errors.items() if m in (0.0,) + MULTIPLES}
    best = min(grid, key=lambda m: (grid[m], m))
    assert chosen.multiple in (0.0, AUTO_FRACTION * best)
    assert held_error(chosen.multiple) <= held_error(0.0) * (1 + 1e-9) + 1e-9
    assert chosen.held_errors[chosen.multiple] == pytest.approx(held_error(chosen.multiple), rel=1e-6, abs=1e-9)
    assert chosen.value == pytest.approx(min(1.0, chosen.multiple * clustered_intensity(rows, length)), abs=1e-12)


def clustered_intensity(rows, length):
    moments = RowMoments()
    moments.add(rows, length)
    return shrinkage_intensity(rows.t() @ rows, moments)


def test_auto_keeps_the_unshrunk_fit_when_the_inputs_are_exactly_low_rank():
    """The issue's regression: shrinking a rank-deficient Gram spends the rank on directions the inputs never take."""
    x = low_rank_plus_noise(0, 64, 1, 32, 6, 1e-6).reshape(-1, 32)
    model = nn.Sequential(nn.Linear(32, 16, dtype=torch.float64))
    report = panther_lite.convert(model, num_terms=1, low_rank=4, calibration_data=[x], progress=False)
    assert report.loc[0, "shrinkage"] == 0.0 and report.loc[0, "output_error"] < 1e-4
    forced = panther_lite.convert(
        nn.Sequential(nn.Linear(32, 16, dtype=torch.float64)), num_terms=1, low_rank=4, calibration_data=[x],
        shrinkage=0.5, progress=False,
    )
    assert forced.loc[0, "output_error"] > 10 * report.loc[0, "output_error"]


def test_auto_shrinks_isotropic_inputs_seen_through_few_rows():
    """Inputs whose true covariance is the identity, seen through barely more rows than inputs:
    the held-back rows ask for a strong shrinkage."""
    x = torch.randn(48, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    report = panther_lite.convert(
        nn.Sequential(nn.Linear(32, 32, dtype=torch.float64)), num_terms=1, low_rank=4, calibration_data=[x],
        progress=False,
    )
    assert report.loc[0, "shrinkage"] > 0.5 * AUTO_FRACTION  # a share of a strength above ½


@pytest.mark.parametrize("sequential", [False, True])
def test_auto_checks_only_layers_up_to_the_side_limit_and_says_so(monkeypatch, sequential):
    """Above AUTO_CHECK_MAX_SIDE on its smaller side a layer's check would cost many times its
    fit: "auto" leaves it unshrunk, keeps no held-back Gram for it and its reason says so,
    while a narrower layer of the same model is still checked."""
    from panther_lite.conversion.calibration import shrinkage

    monkeypatch.setattr(shrinkage, "AUTO_CHECK_MAX_SIDE", 16)
    held_widths = []
    empty = HeldBack.empty.__func__
    monkeypatch.setattr(HeldBack, "empty", classmethod(lambda cls, fan_in, device: held_widths.append(fan_in)
                                                       or empty(cls, fan_in, device)))
    x = torch.randn(48, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.float64), nn.Tanh(), nn.Linear(32, 12, dtype=torch.float64))
    report = panther_lite.convert(model, num_terms=1, low_rank=4, calibration_data=[x], sequential=sequential,
                                  progress=False)
    wide, narrow = report.iloc[0], report.iloc[1]
    assert list(report["status"]) == ["converted", "converted"]
    assert wide["shrinkage"] == 0.0 and "shrinkage='auto' is checked only up to 16" in wide["reason"]
    assert "shrinkage='auto'" not in narrow["reason"]
    assert 32 in held_widths and held_widths.count(32) == 1  # the narrow layer's input only
    fixed = panther_lite.convert(
        nn.Sequential(nn.Linear(32, 32, dtype=torch.float64)), num_terms=1, low_rank=4, calibration_data=[x],
        shrinkage=0.3, sequential=sequential, progress=False,
    )
    assert fixed.loc[0, "shrinkage"] == 0.3 and "shrinkage='auto'" not in fixed.loc[0, "reason"]


def _chosen_on_a_small_layer():
    """``choose_strength`` for a rank-2 fit of an 8 × 16 layer seeing 8 sequences of 4 rows
    (rank-3 inputs plus noise), and those rows."""
    x = low_rank_plus_noise(196, 8, 4, 16, 3, 0.1)
    rows = x.reshape(-1, 16)
    moments, held = RowMoments(), HeldBack.empty(16, None)
    moments.add(rows, 4)
    held.add(rows, 4)
    weight = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(197))
    return rows, choose_strength(weight, 2, rows.t() @ rows, moments, held)


def test_auto_can_stop_at_a_quarter_of_the_ledoit_wolf_strength():
    """A layer whose held-back error is least at ¼·α (below ½·α, the smallest multiple once tried)
    gets ¼·α: on MiniLM the last attention output (α ≈ 0.65) was shrunk by ½·α = 0.32, past where
    its held-back gain flattened, and that one layer cost the embedding 0.003 in domain."""
    rows, chosen = _chosen_on_a_small_layer()
    errors = chosen.held_errors
    assert 0.25 in MULTIPLES and min(MULTIPLES + (0.0,), key=errors.get) == 0.25
    assert errors[0.25] < 0.99 * errors[0.5] and errors[0.25] < 0.96 * errors[0.0]
    assert chosen.multiple == AUTO_FRACTION * 0.25 and errors[chosen.multiple] < errors[0.0]
    assert chosen.value == pytest.approx(AUTO_FRACTION * 0.25 * clustered_intensity(rows, 4), rel=1e-12)


def _designed_errors(monkeypatch, errors_by_multiple):
    """``_Half.error`` replaced by a held-back error curve given per multiple of each half's ``α``."""
    from panther_lite.conversion.calibration import shrinkage

    def error(half, strength, rank):
        multiple = 0.0 if not half.base else round(strength / half.base, 6)
        return errors_by_multiple[multiple] / 2

    monkeypatch.setattr(shrinkage._Half, "error", error)


@pytest.mark.parametrize("share_error, expected", [(0.7, AUTO_FRACTION * 0.5), (1.2, 0.0)])
def test_auto_uses_a_share_of_the_best_multiple_only_when_it_beats_none_on_held_back_rows(
    monkeypatch, share_error, expected
):
    """The best multiple on held-back rows overshoots the model's best: "auto" uses
    AUTO_FRACTION of it, measured there too, and no shrinkage when that share is worse than none."""
    curve = {0.0: 1.0, 0.25: 0.6, 0.5: 0.4, 1.0: 0.5, 2.0: 0.9, round(AUTO_FRACTION * 0.5, 6): share_error}
    _designed_errors(monkeypatch, curve)
    rows, chosen = _chosen_on_a_small_layer()
    assert 0 < AUTO_FRACTION < 1 and chosen.multiple == expected
    assert chosen.value == pytest.approx(expected * clustered_intensity(rows, 4), rel=1e-12)
    assert set(chosen.held_errors) == {0.0, *MULTIPLES, AUTO_FRACTION * 0.5}
