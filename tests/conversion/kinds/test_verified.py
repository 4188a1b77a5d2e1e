"""Linear subclasses that override ``forward`` (issue 29 item 4): converted when their forward
is verified to compute ``x·Wᵀ + b`` on probe inputs ("verified linear" in the report), skipped
with the reason otherwise (a constant added, a nonlinearity, a rescaling, dropout in training,
a forward that fails on plain inputs), also while the weights are still on the meta device."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import panther_lite
from panther_lite.conversion.selection import mark_unconvertible, select_layers
from panther_lite.nn import SKLinear


class Transposed(nn.Linear):
    """FalconLinear's forward: ``input @ W.T`` plus the bias."""

    def forward(self, input):
        hidden = input @ self.weight.T
        return hidden if self.bias is None else hidden + self.bias


class Logged(nn.Linear):
    def forward(self, input):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(input)


class AddsConstant(nn.Linear):
    def forward(self, input):
        return super().forward(input) + 0.5


class Rectified(nn.Linear):
    def forward(self, input):
        return super().forward(input).relu()


class Scaled(nn.Linear):
    def forward(self, input):
        return 1.5 * super().forward(input)


class DropsOut(nn.Linear):
    def forward(self, input):
        return F.dropout(super().forward(input), 0.5, self.training)


class OnlySequences(nn.Linear):
    def forward(self, input):
        if input.dim() != 3:
            raise ValueError("expected (batch, time, features)")
        return super().forward(input)


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({
        name: cls(16, 24, bias=name != "logged")
        for name, cls in (
            ("transposed", Transposed), ("logged", Logged), ("adds_constant", AddsConstant), ("rectified", Rectified),
            ("scaled", Scaled), ("drops_out", DropsOut), ("only_sequences", OnlySequences),
        )
    }).eval()


def test_verified_subclasses_convert_and_the_others_are_skipped_with_their_reason():
    model = _model()
    dense = copy.deepcopy(model)
    report = panther_lite.convert(model, num_terms=1, low_rank=4, progress=False).set_index("name")
    for name in ("transposed", "logged"):
        assert report.loc[name, "status"] == "converted"
        assert report.loc[name, "reason"] == (
            f"verified linear: {type(dense[name]).__name__}.forward computes x·Wᵀ + b on probe inputs"
        )
        assert type(model[name]) is SKLinear
        expected = SKLinear.from_linear(dense[name], 1, 4).effective_weight()
        torch.testing.assert_close(model[name].effective_weight(), expected)
    for name, mode in (("adds_constant", "eval"), ("rectified", "eval"), ("scaled", "eval"), ("drops_out", "training")):
        reason = report.loc[name, "reason"]
        assert report.loc[name, "status"] == "skipped" and type(model[name]) is type(dense[name])
        assert f"overrides Linear.forward" in reason and f"differs from x·Wᵀ + b on probe inputs in {mode} mode" in reason
        assert "register a LayerKind" in reason
    assert "fails on probe inputs (ValueError: expected (batch, time, features))" in report.loc["only_sequences", "reason"]


def test_probing_leaves_the_module_as_it_was_and_fires_no_hooks():
    layer = Logged(8, 8).train()
    weight = layer.weight.detach().clone()
    fired = []
    layer.register_forward_hook(lambda *args: fired.append(1))
    model = nn.Sequential(layer)
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records)
    assert records[0].to_convert and layer.training and not fired
    assert torch.equal(layer.weight, weight) and layer.calls == 4  # two shapes in two modes


def test_meta_weights_are_verified_on_a_copy():
    with torch.device("meta"):
        model = nn.Sequential(Transposed(16, 8), Rectified(8, 8))
    records = select_layers(model, None, None, None)
    mark_unconvertible(model, records, meta_loaded_later=True)
    assert records[0].to_convert and records[0].reason.startswith("verified linear")
    assert records[1].status == "skipped" and "differs from x·Wᵀ + b" in records[1].reason
    assert model[0].weight.is_meta


def test_a_verified_layer_densifies_to_the_same_function():
    model = nn.Sequential(Transposed(16, 24)).eval()
    x = torch.randn(5, 16)
    panther_lite.convert(model, num_terms=1, low_rank=4, progress=False)
    with torch.no_grad():
        expected = model(x)
        panther_lite.densify(model)
        torch.testing.assert_close(model(x), expected)
    assert type(model[0]) is nn.Linear


def test_half_precision_subclasses_are_verified_within_their_rounding():
    layer = Transposed(32, 32).to(torch.bfloat16)
    records = select_layers(nn.Sequential(layer), None, None, None)
    mark_unconvertible(nn.Sequential(layer), records)
    assert records[0].to_convert


def test_transformers_conv1d_subclasses_are_verified_against_their_layout():
    transformers = pytest.importorskip("transformers")

    class Conv1DCopy(transformers.pytorch_utils.Conv1D):
        def forward(self, x):
            return x @ self.weight + self.bias

    class Conv1DShifted(transformers.pytorch_utils.Conv1D):
        def forward(self, x):
            return x @ self.weight

    model = nn.Sequential(Conv1DCopy(24, 16), Conv1DShifted(16, 24))
    with torch.no_grad():
        model[1].bias.fill_(1.0)
    report = panther_lite.convert(model, num_terms=1, low_rank=2, progress=False)
    assert list(report["status"]) == ["converted", "skipped"]
    assert report.loc[0, "reason"].startswith("verified linear") and "differs" in report.loc[1, "reason"]
