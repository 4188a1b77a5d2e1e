"""The run check after a conversion: a converted model that fails to run is rolled back,
and the error names the converted layer involved."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from panther_lite import ConversionError, convert
from panther_lite.nn import SKLinear


class ReadsChild(nn.Module):
    """A block whose forward inspects its child instead of only calling it (as code written
    for dense layers does)."""

    def __init__(self, width=32):
        super().__init__()
        self.proj = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x):
        if not isinstance(self.proj, nn.Linear):
            raise TypeError("this block only works with an nn.Linear proj")
        return self.proj(x)


def snapshot(model):
    return [(name, module) for name, module in model.named_modules()], copy.deepcopy(model.state_dict())


def assert_same_modules(model, before, assert_unchanged):
    modules, state = before
    assert [(name, module) for name, module in model.named_modules()] == modules  # the very same objects
    assert_unchanged(model, state)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("check", ["example_inputs", "calibration_data", "calibration_generator"])
def test_failing_converted_model_is_rolled_back_naming_the_layer(check, assert_unchanged):
    torch.manual_seed(0)
    model = nn.Sequential(ReadsChild(), nn.Linear(32, 8, dtype=torch.float64))
    before = snapshot(model)
    x = torch.randn(4, 32, dtype=torch.float64)
    inputs = {
        "example_inputs": dict(example_inputs=x),
        "calibration_data": dict(calibration_data=[x]),
        "calibration_generator": dict(calibration_data=(batch for batch in [x[:2], x[2:]])),
    }[check]
    with pytest.raises(ConversionError, match=r"converted layer '0\.proj'.*rolled back") as caught:
        convert(model, num_terms=1, low_rank=2, progress=False, **inputs)
    assert caught.value.layers == ["0.proj"]
    assert isinstance(caught.value.__cause__, TypeError)
    assert_same_modules(model, before, assert_unchanged)


def test_failure_in_a_parent_of_several_converted_layers_names_them_all():
    class Pair(ReadsChild):
        def __init__(self):
            super().__init__()
            self.other = nn.Linear(32, 32, dtype=torch.float64)

    model = nn.Sequential(Pair())
    with pytest.raises(ConversionError, match=r"parent of converted layers \['0.proj', '0.other'\]") as caught:
        convert(model, num_terms=1, low_rank=2, example_inputs=torch.randn(2, 32, dtype=torch.float64), progress=False)
    assert caught.value.layers == ["0.proj", "0.other"]
    assert type(model[0].proj) is nn.Linear and type(model[0].other) is nn.Linear


def test_failure_inside_a_converted_layer_names_it(monkeypatch, assert_unchanged):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).double()
    before = snapshot(model)
    forward = SKLinear.forward

    def broken_for_wide_inputs(self, input):
        if self.in_features == 32:
            raise RuntimeError("kernel unavailable")
        return forward(self, input)

    monkeypatch.setattr(SKLinear, "forward", broken_for_wide_inputs)
    with pytest.raises(ConversionError, match="converted layer '2'") as caught:
        convert(model, num_terms=1, low_rank=2, example_inputs=torch.randn(3, 16, dtype=torch.float64), progress=False)
    assert str(caught.value.__cause__) == "kernel unavailable"
    assert_same_modules(model, before, assert_unchanged)


def test_check_runs_in_eval_mode_without_grad_and_keeps_modes():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            seen.append((self.training, torch.is_grad_enabled(), scale))
            return self.lin(x) * scale

    model = Probe().train()
    convert(model, num_terms=1, low_rank=1, example_inputs={"x": torch.randn(2, 8), "scale": 2.0}, progress=False)
    assert seen == [(False, False, 2.0)]
    assert model.training and isinstance(model.lin, SKLinear)


def test_without_example_or_calibration_data_nothing_runs():
    model = nn.Sequential(ReadsChild())
    convert(model, num_terms=1, low_rank=2, progress=False)
    assert isinstance(model[0].proj, SKLinear)
