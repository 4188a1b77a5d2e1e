"""Fits under a metric on the outputs (``output_gram``): the best rank-2Lk fit in
``tr(F (W−Ŵ) G (W−Ŵ)ᵀ)``, against an explicit SVD in float64; no metric is today's fit."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.nn import low_rank_fit
from panther_lite.nn.low_rank_fit import output_metric_roots, sketch_factors_from_weight


def _problem(seed, out=24, fan_in=18, rows=120):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, fan_in, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, fan_in, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, fan_in, dtype=torch.float64)
    g = torch.randn(rows, out, generator=gen, dtype=torch.float64) * torch.linspace(0.05, 4, out, dtype=torch.float64)
    return weight, x.t() @ x, g.t() @ g


def _effective(factors, num_terms):
    S1, U1, U2, S2 = factors
    return ((S1 @ U1 + U2 @ S2) / (2 * num_terms)).t()


def _metric_error(weight, approx, gram, output_gram):
    diff = weight - approx
    return float(torch.trace(output_gram @ diff @ gram @ diff.t()))


def _explicit_fit(weight, gram, output_gram, rank):
    """``F^{-1/2} trunc(F^{1/2} W C) C^{-1}`` with the same damping as the fit, by a full SVD."""
    root, inverse = output_metric_roots(output_gram, weight.shape[0])
    ridge = 1e-4 * gram.diagonal().mean()
    c = torch.linalg.cholesky(gram + ridge * torch.eye(gram.shape[0], dtype=gram.dtype))
    left, values, right = torch.linalg.svd(root @ weight @ c)
    truncated = (left[:, :rank] * values[:rank]) @ right[:rank]
    return inverse @ truncated @ torch.linalg.inv(c)


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("num_terms,low_rank", [(1, 3), (2, 2)])
def test_the_fit_is_the_explicit_metric_weighted_svd(diagonal, num_terms, low_rank):
    weight, gram, output_gram = _problem(0)
    metric = output_gram.diagonal().clone() if diagonal else output_gram
    factors = sketch_factors_from_weight(weight, num_terms, low_rank, gram, output_gram=metric, method="exact")
    full = torch.diag(metric) if diagonal else metric
    expected = _explicit_fit(weight, gram, full, 2 * num_terms * low_rank)
    torch.testing.assert_close(_effective(factors, num_terms), expected, rtol=0, atol=1e-10)


def test_without_a_metric_the_factors_are_todays_bit_for_bit():
    weight, gram, _ = _problem(1)
    rank = 8
    basis = low_rank_fit.output_subspace(weight, rank, gram, method="exact")
    S1, U1, _, _ = sketch_factors_from_weight(weight, 1, 4, gram, method="exact")
    assert torch.equal(S1, weight.t() @ basis[:, :4])
    assert torch.equal(U1, (2.0 * basis[:, :4].t()).contiguous())


def test_an_identity_metric_gives_the_unweighted_fit():
    weight, gram, _ = _problem(2)
    plain = _effective(sketch_factors_from_weight(weight, 1, 4, gram, method="exact"), 1)
    eye = _effective(sketch_factors_from_weight(weight, 1, 4, gram, output_gram=torch.eye(24, dtype=torch.float64),
                                                method="exact"), 1)
    torch.testing.assert_close(eye, plain, rtol=0, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), low_rank=st.integers(1, 5), diagonal=st.booleans())
def test_the_weighted_fit_never_loses_to_the_unweighted_one_in_the_metric(seed, low_rank, diagonal):
    weight, gram, output_gram = _problem(seed)
    metric = output_gram.diagonal().clone() if diagonal else output_gram
    root = output_metric_roots(metric, 24)[0]
    damped = torch.diag(root**2) if diagonal else root @ root  # the metric the fit is optimal in
    weighted = _effective(sketch_factors_from_weight(weight, 1, low_rank, gram, output_gram=metric, method="exact"), 1)
    plain = _effective(sketch_factors_from_weight(weight, 1, low_rank, gram, method="exact"), 1)
    assert _metric_error(weight, weighted, gram, damped) <= _metric_error(weight, plain, gram, damped) * (1 + 1e-9)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_activations_keep_the_layers_scale(method):
    """``x·S1`` has the norm of the first half's output ``x·S1·U1/(2L)`` (``U1``'s rows are
    orthonormal times ``2L``), below the dense output here, however peaked the metric: a float16
    layer overflows only where its own output would."""
    weight, gram, output_gram = _problem(3)
    output_gram = output_gram * 1e6
    output_gram[0, 0] *= 1e4
    S1, U1, _, _ = sketch_factors_from_weight(weight, 1, 4, gram, output_gram=output_gram, method=method)
    x = torch.randn(50, 18, dtype=torch.float64)
    torch.testing.assert_close((x @ S1).norm(), (x @ S1 @ U1 / 2).norm(), rtol=1e-12, atol=0)
    assert (x @ S1).norm() <= (x @ weight.t()).norm()


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_step_on_the_trained_factors_reaches_the_weight_unamplified(diagonal):
    """The fixed ``U1`` has orthonormal rows (times ``2L``) under any metric, as without one: a
    change of ``S1`` moves the effective weight by its own size. Behind ``R⁻¹`` (which a peaked
    Fisher makes 100× and more) fine-tuning's steps would reach the weight amplified."""
    weight, gram, output_gram = _problem(8)
    output_gram[0, 0] *= 1e6
    metric = output_gram.diagonal().clone() if diagonal else output_gram
    num_terms = 2
    S1, U1, U2, S2 = sketch_factors_from_weight(weight, num_terms, 2, gram, output_gram=metric, method="exact")
    eye = torch.eye(U1.shape[0], dtype=torch.float64)
    torch.testing.assert_close(U1 @ U1.t(), (2 * num_terms) ** 2 * eye, rtol=0, atol=1e-10)
    step = torch.randn_like(S1)
    moved = _effective((S1 + step, U1, U2, S2), num_terms) - _effective((S1, U1, U2, S2), num_terms)
    torch.testing.assert_close(moved.norm(), step.norm(), rtol=1e-10, atol=0)


def test_the_sketched_convolution_keeps_its_fixed_factor_orthonormal_under_a_metric():
    from panther_lite.nn import SKConv2d

    gen = torch.Generator().manual_seed(9)
    dense = nn.Conv2d(3, 24, 3).double()
    gram, output_gram = _weighted_problem(24, 27)
    output_gram[0, 0] *= 1e6
    layer = SKConv2d.from_conv2d(dense, num_terms=1, low_rank=2)
    layer.initialize_from_weight(dense.weight, "svd", gram, fit="exact", output_gram=output_gram)
    fixed = [buffer for buffer in layer.buffers() if buffer.shape[-1] == 24][0].reshape(-1, 24)
    torch.testing.assert_close(fixed @ fixed.t(), 4 * torch.eye(fixed.shape[0], dtype=torch.float64), rtol=0, atol=1e-10)
    expected = _explicit_fit(dense.weight.detach().reshape(24, -1), gram, output_gram, 4)
    torch.testing.assert_close(layer.effective_weight().detach().reshape(24, -1), expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "metric,message",
    [
        (torch.ones(5), r"output_gram: expected shape \(24,\) or \(24, 24\), got \(5,\)"),
        (torch.ones(24, 23), r"got \(24, 23\)"),
        (torch.full((24,), float("nan")), "NaN or infinite"),
        (torch.zeros(24), "positive mean diagonal"),
        (-torch.ones(24), "positive"),
    ],
)
def test_a_bad_metric_is_named(metric, message):
    weight, gram, _ = _problem(4)
    with pytest.raises(ValueError, match=message):
        sketch_factors_from_weight(weight, 1, 4, gram, output_gram=metric.double())


@pytest.mark.parametrize("diagonal", [False, True])
def test_the_metric_root_is_its_damped_square_root_scaled_to_one(diagonal):
    _, _, output_gram = _problem(5)
    metric = output_gram.diagonal().clone() if diagonal else output_gram
    root, inverse = output_metric_roots(metric, 24, damping=0.01)
    full_root = torch.diag(root) if diagonal else root
    full_inverse = torch.diag(inverse) if diagonal else inverse
    damped = metric + 0.01 * metric.mean() if diagonal else metric + 0.01 * metric.diagonal().mean() * torch.eye(24, dtype=torch.float64)
    squared = full_root @ full_root
    scale = (torch.diag(damped) if diagonal else damped)[0, 0] / squared[0, 0]
    torch.testing.assert_close(squared * scale, torch.diag(damped) if diagonal else damped, rtol=1e-10, atol=0)
    assert float(torch.linalg.eigvalsh(full_root).max()) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(full_root @ full_inverse, torch.eye(24, dtype=torch.float64), rtol=0, atol=1e-10)


def _weighted_problem(out, fan_in, seed=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(80, fan_in, generator=gen, dtype=torch.float64)
    g = torch.randn(80, out, generator=gen, dtype=torch.float64) * torch.linspace(0.05, 4, out, dtype=torch.float64)
    return x.t() @ x, g.t() @ g


def test_sklinear_fits_under_an_output_metric_as_the_function_does():
    from panther_lite.nn import SKLinear

    gen = torch.Generator().manual_seed(7)
    dense = nn.Linear(18, 24).double()
    gram, output_gram = _weighted_problem(24, 18)
    layer = SKLinear.from_linear(dense, num_terms=1, low_rank=3)
    layer.initialize_from_weight(dense.weight, "svd", gram, fit="exact", output_gram=output_gram)
    expected = _effective(sketch_factors_from_weight(dense.weight.detach(), 1, 3, gram, output_gram=output_gram,
                                                     method="exact"), 1)
    torch.testing.assert_close(layer.effective_weight(), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="output_gram: only used by init='svd'"):
        layer.initialize_from_weight(dense.weight, "sketch", output_gram=output_gram)


def test_skconv2d_fits_under_an_output_metric_to_the_explicit_weighted_svd():
    from panther_lite.nn import SKConv2d

    conv = nn.Conv2d(3, 10, 3).double()
    matrix = conv.weight.detach().reshape(10, -1)
    gram, output_gram = _weighted_problem(10, 27)
    layer = SKConv2d.from_conv2d(conv, 1, 2)
    layer.initialize_from_weight(conv.weight, "svd", gram, fit="exact", output_gram=output_gram)
    expected = _explicit_fit(matrix, gram, output_gram, 4)
    torch.testing.assert_close(layer.effective_weight().reshape(10, -1), expected, rtol=0, atol=1e-10)


def test_skstackedlinear_fits_each_expert_under_its_own_metric():
    from panther_lite.nn import SKStackedLinear

    problems = [_weighted_problem(24, 18, seed) for seed in (1, 2)]
    weight = torch.randn(2, 24, 18, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    layer = SKStackedLinear(2, 18, 24, 1, 3, dtype=torch.float64, seed=0)
    layer.initialize_from_weight(weight, "svd", torch.stack([g for g, _ in problems]), fit="exact",
                                 output_gram=torch.stack([f for _, f in problems]))
    for expert, (gram, output_gram) in enumerate(problems):
        expected = _effective(sketch_factors_from_weight(weight[expert], 1, 3, gram, output_gram=output_gram,
                                                         method="exact"), 1)
        torch.testing.assert_close(layer.effective_weight()[expert], expected, rtol=0, atol=1e-12)
