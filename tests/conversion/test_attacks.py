"""Conversion misuse a user runs into (found by an adversarial pass): converting twice, hooks
on converted layers, interrupted calibration, saving into a file's path, loading with the
wrong factory or a damaged record. Each ends in a correct model or a clear error, and a
failure leaves the model as it was."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.saving.pretrained import PRETRAINED_CONFIG_NAME
from panther_lite.nn import SKLinear

SIZE = dict(num_terms=1, low_rank=2)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _saved_converted_mlp(directory) -> nn.Sequential:
    """A converted MLP, saved with save_pretrained into ``directory``."""
    model = _mlp()
    panther_lite.convert(model, **SIZE)
    panther_lite.save_pretrained(model, directory)
    return model


def _snapshot(model: nn.Module):
    layout = [(name, type(module).__name__) for name, module in model.named_modules()]
    return layout, {key: value.clone() for key, value in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, snapshot) -> None:
    layout, state = _snapshot(model)
    assert layout == snapshot[0]
    assert state.keys() == snapshot[1].keys()
    assert all(torch.equal(state[key], snapshot[1][key]) for key in state)


def test_converting_a_converted_model_says_it_is_converted_and_what_to_do():
    model = _mlp()
    panther_lite.convert(model, target_modules=["0", "2"], **SIZE)
    with pytest.raises(ValueError, match=r"entries \['0'\] matched no.*already holds 2 sketched layers \('0', '2'\)"):
        panther_lite.convert(model, target_modules=["0"], **SIZE)
    panther_lite.convert(model, target_modules=["4"], num_terms=1, low_rank=1)  # the last dense layer
    with pytest.raises(ValueError, match=r"candidates are: none; the model already holds 3 .*densify\(model\) first"):
        panther_lite.convert(model, **SIZE)


def test_forward_hooks_on_a_converted_layer_keep_running_and_their_handles_still_remove_them():
    model = _mlp()
    seen = []
    handle = model[2].register_forward_hook(lambda module, args, output: seen.append(type(module).__name__))
    model[2].register_forward_pre_hook(lambda module, args: (args[0] * 0,))  # changes what the layer sees
    x = torch.randn(3, 16)
    panther_lite.convert(model, example_inputs=x, **SIZE)
    assert isinstance(model[2], SKLinear)
    seen.clear()
    out = model(x)
    assert seen == ["SKLinear"]
    torch.testing.assert_close(model[:4](x), model[3](model[2].bias).expand(3, -1))
    seen.clear()
    handle.remove()
    model(x)
    assert seen == []
    panther_lite.densify(model)
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)  # the pre-hook still zeroes layer 2's input


def test_a_failed_conversion_leaves_hooks_where_they_were():
    model = _mlp()
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(type(module).__name__))
    with pytest.raises(panther_lite.ConversionError):
        panther_lite.convert(model, example_inputs=torch.randn(3, 15), **SIZE)
    model(torch.randn(1, 16))
    assert seen == ["Linear"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_calibration_leaves_the_model_unchanged(interruption):
    model = _mlp()
    before = _snapshot(model)

    def batches():
        yield torch.randn(8, 16)
        raise interruption("stopped midway")

    with pytest.raises(interruption, match="stopped midway"):
        panther_lite.convert(model, calibration_data=batches(), **SIZE)
    _assert_unchanged(model, before)
    assert model.training and all(module.training for module in model.modules())
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in model.modules())


def test_conversion_config_of_a_non_module_is_a_type_error():
    with pytest.raises(TypeError, match="model must be an nn.Module, got int"):
        panther_lite.conversion_config(3)


def test_saving_below_a_file_is_a_clear_error_that_creates_nothing(tmp_path):
    model = _mlp()
    panther_lite.convert(model, **SIZE)
    (tmp_path / "file").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"directory '.*file/sub/dir' is inside '.*file', a file"):
        panther_lite.save_pretrained(model, tmp_path / "file" / "sub" / "dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "factory",
    [
        lambda: nn.Sequential(*_mlp(), nn.Linear(4, 4)),  # one layer more
        lambda: _mlp()[:3],  # a dense layer fewer
        lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5)),
    ],
    ids=["more-layers", "fewer-layers", "other-size"],
)
def test_loading_with_a_factory_of_another_model_names_the_file(tmp_path, factory):
    _saved_converted_mlp(tmp_path)
    with pytest.raises(ValueError, match="model.safetensors' does not fit the model the factory built"):
        panther_lite.from_pretrained(factory, tmp_path)


def test_a_record_without_its_conversion_is_a_clear_error(tmp_path):
    _saved_converted_mlp(tmp_path)
    path = tmp_path / PRETRAINED_CONFIG_NAME
    record = json.loads(path.read_text())
    del record["conversion"]
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="has no 'conversion' dict"):
        panther_lite.from_pretrained(_mlp, tmp_path)


def test_densify_after_save_and_load_keeps_the_function(tmp_path):
    model = _saved_converted_mlp(tmp_path)
    loaded = panther_lite.densify(panther_lite.from_pretrained(_mlp, tmp_path))
    x = torch.randn(5, 16)
    assert [type(m) for m in loaded] == [type(m) for m in _mlp()]
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_layer_whose_forward_is_patched_on_the_instance_stays_dense_with_the_reason():
    """accelerate's device hooks and user monkeypatches replace ``module.forward`` on the
    instance: swapping the layer would silently drop them."""
    model = _mlp()
    dense_forward = model[0].forward
    model[0].forward = lambda x: dense_forward(x).clamp(min=0.5)
    x = torch.randn(4, 16)
    before = model[:2](x)
    report = panther_lite.convert(model, target_modules=["0", "2"], **SIZE).set_index("name")
    assert report.loc["0", "status"] == "skipped" and "forward is replaced on the instance" in report.loc["0", "reason"]
    assert report.loc["2", "status"] == "converted"
    torch.testing.assert_close(model[:2](x), before, rtol=0, atol=0)
