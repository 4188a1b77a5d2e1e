"""Calibration: Gram recording from every batch form, devices, hooks and modes restored."""
from __future__ import annotations

import copy
import importlib
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite import convert
from panther_lite.conversion.kinds.conv import conv_patches


def test_failing_calibration_removes_hooks_and_restores_modes(trained_mlp, assert_unchanged):
    model = copy.deepcopy(trained_mlp).train()
    model[2].eval()
    modes = [m.training for m in model.modules()]
    state = copy.deepcopy(model.state_dict())
    seen = []

    def batches():
        yield torch.zeros(3, 64, dtype=torch.float64)
        seen.append((torch.is_grad_enabled(), model.training))
        raise RuntimeError("data loader broke")

    with pytest.raises(RuntimeError, match="data loader broke"):
        convert(model, param_ratio=0.25, calibration_data=batches(), progress=False)
    assert seen == [(False, False)]  # calibration runs under no_grad in eval mode
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert [m.training for m in model.modules()] == modes
    assert_unchanged(model, state)


def test_calibration_batch_forms_agree(digits, trained_mlp):
    x = digits[0][:300]

    class Scaled(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, scale=1.0):
            return self.net(x * scale)

    forms = {
        "tensor": [x[:100], x[100:]],
        "tuple": [(x[:100], 1.0), (x[100:],)],
        "dict": [{"x": x[:100]}, {"x": x[100:], "scale": 1.0}],
        "callable": lambda m: m(x),
    }
    errors = {}
    for name, data in forms.items():
        model = Scaled(copy.deepcopy(trained_mlp))
        errors[name] = convert(model, param_ratio=0.25, calibration_data=data, progress=False)["output_error"].to_numpy()
    for name in forms:
        assert errors[name] == pytest.approx(errors["tensor"], rel=1e-9)
    with pytest.raises(TypeError, match="calibration batches"):
        convert(Scaled(copy.deepcopy(trained_mlp)), param_ratio=0.25, calibration_data=[3], progress=False)


class KeywordCalls(nn.Module):
    """A conv and a linear layer called with ``input=`` (keyword) or positionally."""

    def __init__(self, keyword):
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.conv = nn.Conv2d(3, 8, 3, padding=1, dtype=torch.float64)
        self.lin = nn.Linear(8 * 25, 16, dtype=torch.float64)

    def forward(self, x):
        h = (self.conv(input=x) if self.keyword else self.conv(x)).relu().flatten(1)
        return self.lin(input=h) if self.keyword else self.lin(h)


def test_calibration_reads_layer_inputs_passed_as_keywords():
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    reports, models = {}, {}
    for keyword in (False, True):
        models[keyword] = KeywordCalls(keyword)
        reports[keyword] = convert(models[keyword], num_terms=1, low_rank=2, calibration_data=[x[:3], x[3:]],
                                   progress=False)
    assert list(reports[True]["init"]) == ["calibrated", "calibrated"]
    assert reports[True]["output_error"].to_numpy() == pytest.approx(reports[False]["output_error"].to_numpy(), rel=1e-12)
    torch.testing.assert_close(models[True](x), models[False](x), rtol=1e-12, atol=1e-12)


CALIBRATION_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("model_device", CALIBRATION_DEVICES)
def test_calibration_device_holds_grams_there_with_the_same_fit(monkeypatch, model_device):
    calibration = importlib.import_module("panther_lite.conversion.calibration.grams")
    strategy = importlib.import_module("panther_lite.conversion.kinds.strategy")
    recorded = []

    class Recording(calibration.GramRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorded.append(self)

    monkeypatch.setattr(strategy, "GramRecorder", Recording)  # the matrix strategy builds the recorders
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, device=model_device)
    results = {}
    for calibration_device in (None, "cpu"):
        recorded.clear()
        model = KeywordCalls(keyword=False).to(model_device)
        report = convert(model, num_terms=1, low_rank=2, calibration_data=[x[:3], x[3:]],
                         calibration_device=calibration_device, progress=False)
        expected = torch.device(model_device if calibration_device is None else "cpu").type
        assert [r.gram.device.type for r in recorded] == [expected, expected]
        assert all(r.rows > 0 for r in recorded)
        assert model.lin.S1.device.type == torch.device(model_device).type
        results[calibration_device] = (report["output_error"].to_numpy(), model(x))
    assert results["cpu"][0] == pytest.approx(results[None][0], rel=1e-9)
    torch.testing.assert_close(results["cpu"][1], results[None][1], rtol=1e-9, atol=1e-12)


def test_layer_not_reached_by_calibration_falls_back_with_a_note():
    model = nn.ModuleDict({"used": nn.Linear(32, 32), "unused": nn.Linear(32, 32)}).double()
    with pytest.warns(UserWarning, match="never reached 'unused'"):
        report = convert(model, num_terms=1, low_rank=2, calibration_data=lambda m: m["used"](torch.randn(8, 32).double()),
                         progress=False).set_index("name")
    assert report.loc["used", "init"] == "calibrated" and not math.isnan(report.loc["used", "output_error"])
    assert report.loc["unused", "init"] == "svd" and "never reached" in report.loc["unused", "reason"]


def two_layer_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()


@pytest.mark.parametrize(
    "model, batch, named",
    [
        (two_layer_mlp, torch.randn(3, 9, dtype=torch.float64), r"layer '0' expects inputs with last dimension"),
        (lambda: nn.Sequential(nn.Conv1d(3, 8, 3)).double(), torch.randn(2, 4, 9, dtype=torch.float64),
         r"layer '0' expects inputs with channels 3"),
    ],
)
def test_calibration_batch_not_fitting_a_layer_is_an_error_naming_it(model, batch, named, assert_unchanged):
    model = model()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=named):
        convert(model, num_terms=1, low_rank=1, calibration_data=[batch], progress=False)
    assert_unchanged(model, state)
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_calibration_inputs_are_an_error_naming_the_layer(bad, assert_unchanged):
    model = two_layer_mlp()
    state, types = copy.deepcopy(model.state_dict()), [type(m) for m in model.modules()]
    batch = torch.randn(5, 8, dtype=torch.float64)
    batch[2, 3] = bad
    with pytest.raises(ValueError, match=r"calibration batch 0 gives layer '0' inputs with NaN/Inf"):
        convert(model, num_terms=1, low_rank=1, calibration_data=[batch], progress=False)
    assert_unchanged(model, state, types)


def test_meta_calibration_device_is_rejected_before_anything_runs():
    calls = []
    with pytest.raises(ValueError, match="calibration_device='meta' holds no values"):
        convert(two_layer_mlp(), num_terms=1, low_rank=1, calibration_data=lambda m: calls.append(m),
                calibration_device="meta", progress=False)
    assert calls == []


@pytest.mark.parametrize("attr", ["weight", "bias"])
def test_non_finite_weights_are_an_error_naming_the_layer_before_calibration(attr, assert_unchanged):
    model = two_layer_mlp()
    with torch.no_grad():
        getattr(model[2], attr).view(-1)[1] = math.inf
    state, types = copy.deepcopy(model.state_dict()), [type(m) for m in model.modules()]
    calls = []
    with pytest.raises(ValueError, match=rf"layer '2': {attr} contains non-finite values \(0 NaN, 1 Inf"):
        convert(model, num_terms=1, low_rank=1, calibration_data=lambda m: calls.append(m), progress=False)
    assert calls == []
    assert_unchanged(model, state, types)


@settings(max_examples=30, deadline=None)
@given(
    dims=st.sampled_from([1, 2, 3]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.integers(0, 2),
    padding_mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
)
def test_conv_patches_times_the_kernel_unfolding_is_the_convolution(dims, kernel, stride, dilation, padding, padding_mode):
    conv_class = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    torch.manual_seed(0)
    conv = conv_class(2, 3, kernel, stride=stride, dilation=dilation, padding=padding, padding_mode=padding_mode,
                      bias=False, dtype=torch.float64)
    x = torch.randn(2, 2, *([6] * dims), dtype=torch.float64)
    patches = conv_patches(conv, x)  # (N·positions, C_in·k1·…)
    expected = conv(x)  # (N, C_out, positions...)
    rows = patches @ conv.weight.reshape(3, -1).t()
    torch.testing.assert_close(rows, expected.movedim(1, -1).reshape(-1, 3), rtol=1e-12, atol=1e-12)


def test_unbatched_conv_inputs_calibrate_like_a_batch_of_one():
    x = torch.randn(3, 9, dtype=torch.float64)
    reports = []
    for batch in (x, x.unsqueeze(0)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv1d(3, 8, 3), nn.Flatten(0)).double()
        reports.append(convert(model, num_terms=1, low_rank=1, calibration_data=[batch], progress=False))
    assert list(reports[0]["init"]) == ["calibrated"]
    assert reports[0]["output_error"].tolist() == pytest.approx(reports[1]["output_error"].tolist(), rel=1e-12)


def test_grams_wider_than_2048_inputs_are_recorded_in_float32(monkeypatch):
    """A Gram over 4M entries is accumulated in float32 (half the memory of float64) and still
    equals the float64 ``XᵀX`` to float32 rounding; narrower ones stay float64."""
    calibration = importlib.import_module("panther_lite.conversion.calibration.grams")
    strategy = importlib.import_module("panther_lite.conversion.kinds.strategy")
    recorded = {}

    class Recording(calibration.GramRecorder):
        def finite_gram(self):
            recorded[self.record.name] = self.gram.clone()
            return super().finite_gram()

    monkeypatch.setattr(strategy, "GramRecorder", Recording)  # the matrix strategy builds the recorders
    model = nn.Sequential(nn.Linear(2050, 8), nn.Linear(8, 4)).double()
    x = torch.randn(2, 3, 2050, dtype=torch.float64)
    convert(model, num_terms=1, low_rank=1, calibration_data=[x[:1], x[1:]], progress=False)
    assert recorded["0"].dtype == torch.float32 and recorded["1"].dtype == torch.float64
    rows = x.reshape(-1, 2050)
    torch.testing.assert_close(recorded["0"].double(), rows.t() @ rows, rtol=1e-5, atol=1e-4)
