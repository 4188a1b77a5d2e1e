"""convert/densify end to end: atomicity, dtype/trainability/mode carried over, progress bars, densify."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from panther_lite import apply_conversion_config, conversion_config, convert, densify
from panther_lite.nn import SKLinear


def test_failing_fit_midway_leaves_model_identical(monkeypatch, trained_mlp, assert_unchanged):
    model = copy.deepcopy(trained_mlp)
    state, types = copy.deepcopy(model.state_dict()), [type(m) for m in model.modules()]
    original = SKLinear.from_linear
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("fit failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(SKLinear, "from_linear", flaky)
    with pytest.raises(RuntimeError, match="fit failed"):
        convert(model, num_terms=1, low_rank=4, progress=False)
    assert_unchanged(model, state, types)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_new_modules_keep_dtype_trainability_and_mode(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Conv2d(4, 32, 3)).to(dtype).train()
    model[0].weight.requires_grad_(False)
    model[1].eval()
    convert(model, num_terms=1, low_rank=4, progress=False)
    sk_linear, sk_conv = model
    assert sk_linear.S1.dtype == sk_linear.U1.dtype == sk_conv.S.dtype == dtype
    assert not sk_linear.S1.requires_grad and not sk_linear.S2.requires_grad and sk_linear.bias.requires_grad
    assert sk_linear.training and not sk_conv.training


def test_progress_bar_can_be_disabled(capsys, named_model):
    convert(named_model(), num_terms=1, low_rank=2, progress=True)
    assert "converting" in capsys.readouterr().err
    convert(named_model(), num_terms=1, low_rank=2, progress=False)
    assert capsys.readouterr().err == ""


def test_densify_round_trip_preserves_outputs(cnn_mlp_model):
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=3, init="sketch", seed=0, progress=False)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    sketched_out = model(x)
    assert densify(model) is model
    assert [type(m) for m in model] == [nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]
    torch.testing.assert_close(model(x), sketched_out, rtol=1e-12, atol=1e-12)
    layer = SKLinear(16, 8, 1, 2, dtype=torch.float64)
    dense = densify(layer)
    torch.testing.assert_close(dense(torch.ones(2, 16, dtype=torch.float64)), layer(torch.ones(2, 16, dtype=torch.float64)))


def test_densify_and_apply_conversion_config_keep_shared_layers_shared():
    shared = SKLinear(16, 16, 1, 2, dtype=torch.float64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 16, dtype=torch.float64)
    sketched_out = model(x)
    densify(model)
    assert type(model[0]) is nn.Linear and model[2] is model[0]
    torch.testing.assert_close(model(x), sketched_out)

    sketched = nn.Sequential(shared, nn.ReLU(), shared)
    dense = nn.Linear(16, 16, dtype=torch.float64)
    fresh = nn.Sequential(dense, nn.ReLU(), dense)
    apply_conversion_config(fresh, conversion_config(sketched))
    assert type(fresh[0]) is SKLinear and fresh[2] is fresh[0]
    fresh.load_state_dict(sketched.state_dict())
    torch.testing.assert_close(fresh(x), sketched_out, rtol=0, atol=0)
