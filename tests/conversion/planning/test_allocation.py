"""Global rank allocation: one budget for many layers (panther_lite.conversion.planning.allocation)."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.conversion.planning.allocation import LayerSpectrum, allocate_budget, minimum_stored, whitened_energy
from panther_lite.nn import SKLinear
from panther_lite.nn.rank_selection import dense_size, select_config, sketch_size


def _spectrum(fan_in, fan_out, decay, scale=1.0):
    """Strictly positive, geometrically decaying squared singular values."""
    energy = scale * torch.exp(-decay * torch.arange(min(fan_in, fan_out), dtype=torch.float64))
    return LayerSpectrum(fan_in, fan_out, True, energy)


def _error(layer, low_rank, num_terms=1):
    if low_rank is None:
        return 0.0
    energy = layer.energy
    return float(energy[2 * num_terms * low_rank :].sum() / energy.sum())


def _options(layer):
    """Every size of the layer: ranks storing less than dense, then dense (None)."""
    dense = dense_size(layer.fan_in, layer.fan_out, layer.bias)
    ranks = itertools.takewhile(
        lambda k: sketch_size(layer.fan_in, layer.fan_out, 1, k, layer.bias).stored < dense, itertools.count(1)
    )
    out = [(k, sketch_size(layer.fan_in, layer.fan_out, 1, k, layer.bias).stored) for k in ranks]
    return out + [(None, dense)]


layer_strategy = st.builds(
    _spectrum,
    fan_in=st.integers(2, 40),
    fan_out=st.integers(2, 40),
    decay=st.floats(0.0, 2.0),
    scale=st.floats(0.01, 100.0),
)


@settings(max_examples=100, deadline=None)
@given(layers=st.lists(layer_strategy, min_size=1, max_size=5), fraction=st.floats(0.0, 1.2))
def test_plan_never_exceeds_the_budget_and_leaves_no_affordable_improvement(layers, fraction):
    floor = minimum_stored(layers)
    total_dense = sum(dense_size(l.fan_in, l.fan_out, l.bias) for l in layers)
    budget = floor + fraction * (total_dense - floor)
    plan = allocate_budget(layers, budget)
    spent = sum(a.stored for a in plan)
    assert spent <= budget
    left = budget - spent
    for layer, allocation in zip(layers, plan):
        assert allocation.error == pytest.approx(_error(layer, allocation.low_rank), abs=1e-12)
        if allocation.low_rank is None:
            continue
        for low_rank, stored in _options(layer):
            lowers = low_rank is None or _error(layer, low_rank) < allocation.error
            if lowers and stored > allocation.stored:
                assert stored - allocation.stored > left  # an improvement that fits would have been taken


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(layer_strategy, min_size=1, max_size=3), fraction=st.floats(0.0, 1.0))
def test_small_budgets_get_the_exact_optimum(layers, fraction):
    floor = minimum_stored(layers)
    total_dense = sum(dense_size(l.fan_in, l.fan_out, l.bias) for l in layers)
    budget = min(4096, floor + fraction * (total_dense - floor))
    if budget < floor:
        return
    best = min(
        sum(_error(layer, k) for layer, (k, _) in zip(layers, combo))
        for combo in itertools.product(*map(_options, layers))
        if sum(stored for _, stored in combo) <= budget
    )
    assert sum(a.error for a in allocate_budget(layers, budget)) == pytest.approx(best, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(layer_strategy, min_size=1, max_size=4), ratio=st.floats(0.05, 0.9))
def test_global_plan_is_never_worse_than_the_uniform_one(layers, ratio):
    uniform = [select_config(l.fan_in, l.fan_out, ratio) for l in layers]
    budget = ratio * sum(dense_size(l.fan_in, l.fan_out, l.bias) for l in layers)
    if any(c is None or sketch_size(l.fan_in, l.fan_out, *c).stored >= dense_size(l.fan_in, l.fan_out) for l, c in zip(layers, uniform)) or budget > 4096:
        return  # uniform keeps a layer dense (over budget), or the plan is not exact
    uniform_error = sum(_error(l, c[1]) for l, c in zip(layers, uniform))
    assert sum(a.error for a in allocate_budget(layers, budget)) <= uniform_error + 1e-12


def test_compressible_layers_give_rank_to_incompressible_ones():
    steep, flat = _spectrum(256, 256, decay=0.5), _spectrum(256, 256, decay=0.001)
    budget = 0.25 * 2 * dense_size(256, 256)
    plan = allocate_budget([steep, flat], budget)
    assert plan[0].low_rank < plan[1].low_rank
    assert sum(a.stored for a in plan) >= 0.97 * budget


def test_a_layer_no_sketch_can_pay_for_stays_dense_and_alignment_is_kept():
    narrow = LayerSpectrum(64, 2, True, torch.ones(2, dtype=torch.float64))  # rank 1 stores 134 > 130
    wide = LayerSpectrum(512, 512, True, _spectrum(512, 512, decay=0.01).energy, multiple=8)
    plan = allocate_budget([narrow, wide], 0.3 * (dense_size(64, 2) + dense_size(512, 512)))
    assert plan[0].low_rank is None and plan[0].stored == dense_size(64, 2)
    assert plan[1].low_rank % 8 == 0


def test_budget_below_the_smallest_sizes_is_an_error():
    layers = [_spectrum(64, 64, 0.1)]
    with pytest.raises(ValueError, match="param_ratio"):
        allocate_budget(layers, minimum_stored(layers) - 1)


@pytest.mark.parametrize("shape", [(12, 30), (30, 12)])
def test_whitened_energy_is_the_spectrum_the_fit_truncates(shape):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, dtype=torch.float64, generator=generator)
    x = torch.randn(200, shape[1], dtype=torch.float64, generator=generator) * torch.linspace(0.1, 3, shape[1], dtype=torch.float64)
    gram = x.t() @ x
    ridge = 1e-4 * gram.diagonal().mean()
    eigvals, eigvecs = torch.linalg.eigh(gram + ridge * torch.eye(shape[1], dtype=torch.float64))
    root = (eigvecs * eigvals.sqrt()) @ eigvecs.t()
    expected = torch.linalg.svdvals(weight @ root) ** 2
    torch.testing.assert_close(whitened_energy(weight, gram), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(whitened_energy(weight), torch.linalg.svdvals(weight) ** 2, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", [(12, 30), (30, 12)])
@pytest.mark.parametrize("diagonal", [False, True])
def test_the_fisher_weighted_energy_beyond_a_rank_is_that_fits_error_in_the_fishers_units(shape, diagonal):
    generator = torch.Generator().manual_seed(0)
    fan_out, fan_in = shape
    weight = torch.randn(*shape, dtype=torch.float64, generator=generator)
    x = torch.randn(200, fan_in, dtype=torch.float64, generator=generator) * torch.linspace(0.1, 3, fan_in, dtype=torch.float64)
    g = torch.randn(300, fan_out, dtype=torch.float64, generator=generator) * torch.linspace(3, 0.1, fan_out, dtype=torch.float64)
    gram, fisher = x.t() @ x, (g * g).sum(0) if diagonal else g.t() @ g
    energy = whitened_energy(weight, gram, output_gram=fisher)
    ridge = 1e-4 * gram.diagonal().mean() * torch.eye(fan_in, dtype=torch.float64)
    eigvals, eigvecs = torch.linalg.eigh(gram + ridge)
    input_root = (eigvecs * eigvals.sqrt()) @ eigvecs.t()
    metric = torch.diag(fisher) if diagonal else fisher
    eigvals, eigvecs = torch.linalg.eigh(metric + 1e-2 * metric.diagonal().mean() * torch.eye(fan_out, dtype=torch.float64))
    output_root = (eigvecs * eigvals.sqrt()) @ eigvecs.t()
    for low_rank in (1, 2, 3):
        layer = SKLinear(fan_in, fan_out, num_terms=1, low_rank=low_rank, dtype=torch.float64, seed=0)
        layer.initialize_from_weight(weight, "svd", gram, output_gram=fisher)
        error = output_root @ (weight - layer.effective_weight().detach()) @ input_root
        torch.testing.assert_close(energy[2 * low_rank:].sum(), (error ** 2).sum(), rtol=1e-8, atol=0)
    torch.testing.assert_close(energy.sum(), ((output_root @ weight @ input_root) ** 2).sum(), rtol=1e-10, atol=0)


def test_an_output_metric_of_the_wrong_size_is_named():
    with pytest.raises(ValueError, match=r"output_gram: expected shape \(6,\) or \(6, 6\), got \(4,\)"):
        whitened_energy(torch.randn(6, 5), output_gram=torch.ones(4))
