"""Sequential calibration: layers fitted in model order to the original outputs, on the inputs
the partly converted model gives them (panther_lite.conversion.fitting.sequential)."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.fitting import sequential
from panther_lite.conversion.calibration.shrinkage import AUTO_FRACTION, MULTIPLES, RowMoments, shrink, shrinkage_intensity
from panther_lite.nn import SKLinear


def deep_mlp(width=48, depth=6, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*layers)


def inputs(width=48, rows=1024, seed=1):
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, dtype=torch.float64, generator=generator)
    return torch.randn(rows, width, dtype=torch.float64, generator=generator) @ mix * 0.3


class Attention(nn.Module):
    """q/k/v projections of one hidden state, then an output projection."""

    def __init__(self, width=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, dtype=torch.float64) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.o(weights @ v)


def relative(a, b):
    return float((a - b).norm() / b.norm())


def test_sequential_fit_beats_independent_fits_on_the_final_output():
    x = inputs()
    batches = list(x.split(256))
    reference = deep_mlp()
    with torch.no_grad():
        dense_out = reference(x)
    errors = {}
    for sequential_fit in (False, True):
        model = deep_mlp()
        panther_lite.convert(model, param_ratio=0.3, calibration_data=batches, sequential=sequential_fit, progress=False)
        with torch.no_grad():
            errors[sequential_fit] = relative(model(x), dense_out)
    assert errors[True] < 0.95 * errors[False]


def test_each_layer_solves_the_reduced_rank_regression_on_its_current_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10, dtype=torch.float64), nn.Tanh(), nn.Linear(10, 8, dtype=torch.float64))
    original = [layer.weight.detach().clone() for layer in (model[0], model[2])]
    x = inputs(12, 400)
    with torch.no_grad():
        dense_hidden = torch.tanh(model[0](x))
    report = panther_lite.convert(model, num_terms=1, low_rank=2, calibration_data=[x[:200], x[200:]], sequential=True, progress=False)
    assert list(report["init"]) == ["sequential", "sequential"]
    with torch.no_grad():
        current_hidden = torch.tanh(model[0](x))
    # reduced-rank regression of dense_hidden @ W2ᵀ on current_hidden, rank 2Lk = 4, with the
    # off-diagonal statistics shrunk by the strength "auto" reports (a share of a multiple of the
    # rows' Ledoit–Wolf intensity) and a ridge towards W
    w = original[1]
    moments = RowMoments()
    moments.add(current_hidden)
    raw_gram = current_hidden.t() @ current_hidden
    alpha = float(report.loc[1, "shrinkage"])
    multiple = alpha / shrinkage_intensity(raw_gram, moments) / AUTO_FRACTION
    assert 0 < alpha < 1 and min(abs(multiple - m) for m in MULTIPLES) < 1e-9
    gram, cross = (shrink(m, alpha) for m in (raw_gram, current_hidden.t() @ dense_hidden))
    ridge = sequential.RIDGE * raw_gram.diagonal().mean() * torch.eye(10, dtype=torch.float64)
    least_squares = torch.linalg.solve(gram + ridge, (cross + ridge) @ w.t()).t()
    eigvals, eigvecs = torch.linalg.eigh(gram)
    root = (eigvecs * eigvals.clamp_min(0).sqrt()) @ eigvecs.t()
    basis = torch.linalg.svd(least_squares @ root).U[:, :4]
    expected = basis @ basis.t() @ least_squares
    assert isinstance(model[2], SKLinear)
    fitted = model[2].effective_weight().detach()
    assert relative(current_hidden @ fitted.t(), current_hidden @ expected.t()) < 1e-3
    assert report.loc[1, "output_error"] == pytest.approx(
        relative(current_hidden @ fitted.t(), dense_hidden @ w.t()), rel=1e-6
    )


def test_with_nothing_upstream_it_matches_the_calibrated_fit():
    x = inputs(16, 300)
    fits = {}
    for sequential_fit in (False, True):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64))
        panther_lite.convert(model, num_terms=1, low_rank=3, calibration_data=[x], sequential=sequential_fit, progress=False)
        fits[sequential_fit] = model[0].effective_weight().detach()
    assert relative(x @ fits[True].t(), x @ fits[False].t()) < 1e-3


def test_projections_of_one_input_share_statistics_and_each_group_is_freed_before_the_next(monkeypatch):
    model = nn.Sequential(Attention(), nn.Tanh(), Attention())
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    created, alive_at_creation = [], []
    original_init = sequential._GroupStatistics.__init__

    def tracking_init(self, group, *args):
        gc.collect()
        alive_at_creation.append(sum(ref() is not None for ref in created))
        original_init(self, group, *args)
        created.append(weakref.ref(self))

    monkeypatch.setattr(sequential._GroupStatistics, "__init__", tracking_init)
    report = panther_lite.convert(model, num_terms=1, low_rank=2, calibration_data=[x, x * 0.5], sequential=True, progress=False)
    assert (report["status"] == "converted").all()
    # groups: {0.q, 0.k, 0.v}, {0.o}, {2.q, 2.k, 2.v}, {2.o}: one statistics object each, none alive together
    assert len(created) == 4
    assert alive_at_creation == [0, 0, 0, 0]


def test_group_layers_orders_by_first_call_and_groups_identical_inputs():
    model = nn.Sequential(Attention(), nn.Tanh(), Attention())
    from panther_lite.conversion.selection import select_layers

    records = select_layers(model, None, None, None)
    order = sequential.group_layers(model, records, torch.randn(2, 3, 16, dtype=torch.float64))
    assert [[r.name for r in g] for g in order.groups] == [["0.q", "0.k", "0.v"], ["0.o"], ["2.q", "2.k", "2.v"], ["2.o"]]
    assert order.unreached == [] and set(order.calls.values()) == {1}


@pytest.mark.parametrize("data,error", [(None, ValueError), (iter([torch.zeros(1, 48)]), TypeError)])
def test_sequential_needs_reiterable_batches(data, error):
    model = deep_mlp(depth=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match="calibration_data"):
        panther_lite.convert(model, param_ratio=0.3, calibration_data=data, sequential=True, progress=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_deterministic_callable_fits_like_its_batches():
    x = inputs()
    batches = list(x.split(256))
    fitted = {}
    for name, data in {"batches": batches, "callable": lambda m: [m(b) for b in batches]}.items():
        model = deep_mlp(depth=3)
        report = panther_lite.convert(model, param_ratio=0.3, calibration_data=data, sequential=True, progress=False)
        assert list(report["init"]) == ["sequential"] * 3
        with torch.no_grad():
            fitted[name] = model(x)
    torch.testing.assert_close(fitted["callable"], fitted["batches"], rtol=1e-10, atol=1e-12)


def test_a_callable_that_changes_between_runs_is_refused():
    model = deep_mlp(depth=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sampling = lambda m: m(torch.randn(64, 48, dtype=torch.float64))  # noqa: E731 (new rows on every run)
    with pytest.raises(ValueError, match="different inputs although nothing before it was converted"):
        panther_lite.convert(model, param_ratio=0.3, calibration_data=sampling, sequential=True, progress=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_sequential_needs_the_svd_fit():
    with pytest.raises(ValueError, match="sequential"):
        panther_lite.convert(deep_mlp(depth=1), param_ratio=0.3, init="sketch", calibration_data=[inputs()], sequential=True)


def test_each_run_stops_once_the_group_is_done():
    model = deep_mlp(depth=6)
    last, calls = model[10], []
    last.register_forward_hook(lambda module, *args: calls.append(module is last))  # the hook moves to the new layer
    x = inputs()
    panther_lite.convert(model, param_ratio=0.3, calibration_data=[x[:256], x[256:512]], sequential=True, progress=False)
    # the grouping run, then its own group's two runs per batch; the five earlier groups stop before it
    assert sum(calls) == 1 + 2 * 2
