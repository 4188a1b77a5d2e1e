"""conversion_config / apply_conversion_config: a converted state_dict loads into a fresh model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from panther_lite import convert
from panther_lite.nn import SKConv2d, SKLinear
import json

from panther_lite import apply_conversion_config, conversion_config


def test_state_dict_loads_into_fresh_model_with_saved_config(tmp_path, cnn_mlp_model):
    model = cnn_mlp_model()
    convert(model, param_ratio=0.3, rank_pattern={"5": (2, 3)}, progress=False)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "conversion.json").write_text(json.dumps(conversion_config(model)))

    fresh = cnn_mlp_model()
    config = json.loads((tmp_path / "conversion.json").read_text())
    assert [(c["name"], c["kind"], c["num_terms"]) for c in config["layers"]] == [
        ("0", "SKConv2d", 1), ("3", "SKLinear", 1), ("5", "SKLinear", 2)
    ]
    apply_conversion_config(fresh, config)
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_apply_conversion_config_mismatch_changes_nothing(assert_unchanged, cnn_mlp_model):
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=2, progress=False)
    config = conversion_config(model)
    other = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 36, 64),
                          nn.ReLU(), nn.Linear(64, 32)).double()
    state, types = copy.deepcopy(other.state_dict()), [type(m) for m in other.modules()]
    with pytest.raises(ValueError, match="'5' has weight shape"):
        apply_conversion_config(other, config)
    assert_unchanged(other, state, types)
    with pytest.raises(ValueError, match="format"):
        apply_conversion_config(other, {"layers": []})


def _config_with(model, change):
    config = conversion_config(model)
    change(config)
    return config


def _entry(field, value):
    def change(config):
        config["layers"][0][field] = value

    return change


def _drop(field):
    def change(config):
        del config["layers"][0][field]

    return change


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("layers"), "no 'layers' list"),
        (lambda c: c.update(layers={"name": "3"}), r"config\['layers'\] must be a list"),
        (lambda c: c["layers"].append("3"), r"config\['layers'\]\[2\] must be a dict"),
        (_drop("num_terms"), r"config\['layers'\]\[0\] is missing \['num_terms'\]"),
        (_entry("bias", "false"), r"layer '3'\): 'bias' must be true or false"),
        (_entry("num_terms", "1"), r"layer '3'\): 'num_terms' must be an integer >= 1"),
        (_entry("low_rank", 0), r"layer '3'\): 'low_rank' must be an integer >= 1"),
        (_entry("shape", "64x576"), r"layer '3'\): 'shape' must be a list of positive integers"),
        (_entry("name", 3), r"\['name'\] must be a dotted module name"),
        (_entry("kind", "SKEmbedding"), "unknown kind 'SKEmbedding'"),
        (_entry("dense", "Conv2d"), "unknown kind 'SKLinear' with dense 'Conv2d'"),
        (lambda c: c["layers"].append(dict(c["layers"][0])), r"lists \['3'\] more than once"),
        (_entry("name", "7"), "layer '7' from the config does not exist"),
    ],
)
def test_malformed_config_is_rejected_naming_the_field_before_any_change(change, message, cnn_mlp_model,
                                                                          assert_unchanged):
    converted = cnn_mlp_model()
    convert(converted, target_modules=["3", "5"], num_terms=1, low_rank=2, progress=False)
    config = _config_with(converted, change)
    fresh = cnn_mlp_model()
    state, types = copy.deepcopy(fresh.state_dict()), [type(m) for m in fresh.modules()]
    with pytest.raises(ValueError, match=message):
        apply_conversion_config(fresh, config)
    assert_unchanged(fresh, state, types)


def test_config_written_before_the_dense_field_still_applies(cnn_mlp_model):
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=2, progress=False)
    config = conversion_config(model)
    for entry in config["layers"]:
        del entry["dense"]
    fresh = apply_conversion_config(cnn_mlp_model(), config)
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_config_applies_to_a_model_on_the_meta_device(cnn_mlp_model):
    model = cnn_mlp_model()
    convert(model, num_terms=1, low_rank=2, progress=False)
    with torch.device("meta"):
        skeleton = cnn_mlp_model()
    apply_conversion_config(skeleton, conversion_config(model))
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    skeleton.load_state_dict(model.state_dict(), assign=True)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(skeleton(x), model(x), rtol=0, atol=0)
