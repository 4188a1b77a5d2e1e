"""The conversion report: sizes, weight and output errors, summary, budgets and aligned ranks."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite import conversion_summary, convert
from panther_lite.nn import SKLinear, select_config


def test_report_errors_match_direct_computation(digits, trained_mlp):
    x = digits[0]
    model = copy.deepcopy(trained_mlp)
    with torch.no_grad():
        hidden = trained_mlp[1](trained_mlp[0](x))  # input of layer "2"
    report = convert(model, param_ratio=0.25, calibration_data=[x[:700], x[700:]], exclude_modules=["4"], progress=False)
    for name, inputs in (("0", x), ("2", hidden)):
        row = report.set_index("name").loc[name]
        dense, sketched = trained_mlp.get_submodule(name), model.get_submodule(name)
        w, w_hat = dense.weight, sketched.effective_weight().detach()
        expected_output = ((inputs @ (w - w_hat).t()).norm() / (inputs @ w.t()).norm()).item()
        assert row["output_error"] == pytest.approx(expected_output, rel=1e-9)
        assert row["weight_error"] == pytest.approx(((w_hat - w).norm() / w.norm()).item(), rel=1e-12)
        assert row["trainable_params"] == sum(p.numel() for p in sketched.parameters())
        assert row["stored_params"] == row["trainable_params"] + sum(b.numel() for b in sketched.buffers())
        assert row["dense_params"] == dense.weight.numel() + dense.bias.numel()
    before = sum(p.numel() for p in trained_mlp.parameters())
    after = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
    summary = report.attrs["summary"]
    assert summary == conversion_summary(report)
    assert summary.startswith("converted 2 of 2 selected layers")
    assert f"whole model {before:,} → {after:,}" in summary


@pytest.mark.parametrize(
    "options",
    [
        dict(padding=1),
        dict(padding="same", padding_mode="reflect"),
        dict(padding=2, stride=2, dilation=2, padding_mode="circular"),
        dict(padding="valid", kernel_size=(3, 2), bias=False),
    ],
)
def test_conv_output_error_matches_convolution_outputs(options):
    options = dict(dict(kernel_size=3), **options)
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 16, dtype=torch.float64, **options)
    model = nn.Sequential(conv)
    x = torch.randn(5, 6, 9, 9, dtype=torch.float64)
    reference = copy.deepcopy(conv)
    report = convert(model, num_terms=1, low_rank=2, calibration_data=[x[:2], x[2:]], progress=False)
    with torch.no_grad():
        diff = model[0](x) - reference(x)
        signal = reference(x) - (0 if reference.bias is None else reference.bias[:, None, None])
    assert report.loc[0, "output_error"] == pytest.approx((diff.norm() / signal.norm()).item(), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    fan_in=st.integers(1, 96),
    fan_out=st.integers(1, 96),
    ratio=st.floats(0.01, 1.0),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_param_ratio_budget_is_respected_or_layer_kept_dense(fan_in, fan_out, ratio, bias, dtype):
    model = nn.Sequential(nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype))
    report = convert(model, param_ratio=ratio, progress=False)
    row = report.loc[0]
    config = select_config(fan_in, fan_out, ratio, bias=bias)  # align="auto": no rounding on the CPU
    if row["status"] == "converted":
        assert isinstance(model[0], SKLinear) and model[0].S1.dtype == dtype
        assert (row["num_terms"], row["low_rank"]) == config
        assert row["stored_params"] <= ratio * row["dense_params"]
        assert row["stored_params"] < row["dense_params"]
    else:
        assert row["status"] == "kept dense" and type(model[0]) is nn.Linear
        assert row["stored_params"] == row["dense_params"]


def test_ranks_are_aligned_only_when_asked_or_on_tensor_cores():
    def low_ranks(**kwargs):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024, dtype=torch.float64))
        return list(convert(model, param_ratio=0.25, progress=False, **kwargs)["low_rank"])

    assert low_ranks() == [63, 63]  # align="auto": no tensor cores on the CPU, so the largest rank that fits
    assert low_ranks(align=4) == [60, 60]  # rounding down to 4 costs under a tenth of the budget
