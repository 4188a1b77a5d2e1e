"""panther_lite.tune: the smallest global budget within a tolerance of the dense score."""
import math

import pytest
import torch
import torch.nn as nn

from panther_lite.conversion import convert
from panther_lite.conversion.workflows.tune import bisect_budget, tune
from panther_lite.figures import plot_search
from panther_lite.nn import SKLinear


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(256, 32)
    with torch.no_grad():
        reference = model(x)
    return model, x, reference


def closeness(x, reference):
    """A score in [0, 1]: 1 - relative output error against the dense model."""

    def evaluate(model):
        with torch.no_grad():
            return 1.0 - float((model(x) - reference).norm() / reference.norm())

    return evaluate


def snapshot(model):
    return [(name, type(m)) for name, m in model.named_modules()], {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("threshold", [0.003, 0.05, 0.2, 0.9])
def test_bisection_finds_the_threshold_within_the_resolution_in_few_trials(threshold):
    tried = []

    def passes(budget):
        tried.append(budget)
        return budget >= threshold

    found = bisect_budget(passes, 0.01, 1.0, resolution=0.03, max_evaluations=12)
    if threshold <= 0.01:
        assert found == 0.01
        return
    assert found >= threshold and any(threshold / (1.03) ** 2 <= b < threshold for b in tried)
    grid = math.ceil(math.log(100) / math.log(1.03))
    assert len(tried) <= 10 < grid


def test_tune_converts_at_the_smallest_passing_budget_and_keeps_the_trace():
    model, x, reference = model_and_data()
    evaluate = closeness(x, reference)
    # an untrained network on isotropic inputs leaves compression little room: 10%
    report = tune(model, evaluate, tolerance=0.10, calibration_data=[x], progress=False)
    trace = report.attrs["search"]
    chosen = report.attrs["tune_budget"]
    assert list(trace.columns) == ["budget", "score", "stored_params", "stored_ratio", "seconds", "passed"]
    assert trace.iloc[0]["budget"] == 1.0 and trace.iloc[0]["passed"]
    assert evaluate(model) >= 1.0 - 0.10 - 1e-9
    assert isinstance(model[0], SKLinear) or isinstance(model[2], SKLinear)
    failing = trace[~trace["passed"]]["budget"]
    assert chosen < 1.0 and (failing >= chosen / 1.03 ** 2).any()
    assert (trace["budget"] == chosen).sum() == 1 and evaluate(model) == pytest.approx(
        float(trace[trace["budget"] == chosen]["score"].iloc[0])
    )
    assert len(trace) <= 11
    assert report["stored_params"].sum() <= chosen * report["dense_params"].sum()


def test_tune_at_a_tight_tolerance_compresses_a_model_whose_inputs_are_low_rank():
    """Issue 30's regression: inputs spanning 6 of 32 directions leave a rank-8 fit exact, which
    tune finds at tolerance 2e-3; a Gram always shrunk towards its diagonal spent the rank on
    directions the inputs never take, and tune kept the model dense."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(64, 6) @ torch.randn(6, 32) + 1e-4 * torch.randn(64, 32)
    with torch.no_grad():
        reference = model(x)
    report = tune(model, closeness(x, reference), tolerance=2e-3, calibration_data=[x], progress=False)
    assert report.attrs["tune_budget"] < 1.0 and isinstance(model[0], SKLinear)
    assert report.loc[report["name"] == "0", "shrinkage"].item() == 0.0
    assert closeness(x, reference)(model) >= 1.0 - 2e-3


def test_tuning_a_converted_model_warns_that_its_reference_is_not_the_dense_one(recwarn):
    model, x, reference = model_and_data()
    tune(model, closeness(x, reference), tolerance=0.0, calibration_data=[x], progress=False, max_evaluations=1)
    assert not [w for w in recwarn if "already holds" in str(w.message)]  # a dense model: no warning
    convert(model, param_ratio=0.5, calibration_data=[x], progress=False, target_modules=["0", "2"])
    with pytest.warns(UserWarning, match=r"already holds 2 sketched or frozen layers \(0, 2\)"):
        tune(model, closeness(x, reference), tolerance=0.0, calibration_data=[x], progress=False, max_evaluations=1)


def test_an_unreachable_tolerance_leaves_the_model_dense():
    model, x, reference = model_and_data()
    report = tune(model, closeness(x, reference), tolerance=0.0, calibration_data=[x], progress=False, max_evaluations=3)
    assert not any(isinstance(m, SKLinear) for m in model.modules())
    assert (report["status"] == "kept dense").all() and report.attrs["tune_budget"] == 1.0


def test_an_error_in_evaluate_leaves_the_model_unchanged():
    model, x, reference = model_and_data()
    before = snapshot(model)
    calls = []

    def flaky(m):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("evaluation failed")
        return closeness(x, reference)(m)

    with pytest.raises(RuntimeError, match="evaluation failed"):
        tune(model, flaky, tolerance=0.1, calibration_data=[x], progress=False)
    after = snapshot(model)
    assert after[0] == before[0]
    assert all(torch.equal(after[1][k], v) for k, v in before[1].items())


def test_plot_search_draws_score_against_size():
    model, x, reference = model_and_data()
    report = tune(model, closeness(x, reference), tolerance=0.2, calibration_data=[x], progress=False, max_evaluations=4)
    ax = plot_search(report)
    xs, ys = ax.lines[0].get_data()
    assert len(xs) == len(report.attrs["search"]) and max(xs) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(tolerance=-1), ValueError, "tolerance"),
        (dict(tolerance=0.1, param_ratio=0.5), ValueError, "param_ratio"),
        (dict(tolerance=0.1, ratio_range=(0.5, 0.1)), ValueError, "ratio_range"),
        (dict(tolerance=0.1, max_evaluations=0), ValueError, "max_evaluations"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    model, x, reference = model_and_data()
    with pytest.raises(error, match=match):
        tune(model, closeness(x, reference), **kwargs)


def test_evaluate_must_be_callable_and_return_a_number():
    model, x, _ = model_and_data()
    with pytest.raises(TypeError, match="evaluate"):
        tune(model, 0.5, tolerance=0.1)
    with pytest.raises(TypeError, match="evaluate"):
        tune(model, lambda m: "good", tolerance=0.1)
