"""A user's own layer type through the one kind registry: the documented example
("Extending: your own layer kind" in docs/workflows.rst, run here as written) converts,
densifies, freezes and saves like the built-in kinds; registration errors are named; a kind
for an nn.Linear subclass wins over the built-in one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import panther_lite
from panther_lite.conversion import FrozenLinear, LinearKind
from panther_lite.conversion.kinds import kind_of, unregister_kind
from panther_lite.nn import SKLinear

WORKFLOWS = Path(__file__).resolve().parents[3] / "docs" / "workflows.rst"


def _documented_example() -> str:
    """The code block of the "Extending: your own layer kind" section, dedented."""
    text = WORKFLOWS.read_text()
    section = text[text.index("Extending: your own layer kind"):]
    block = re.search(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", section).group(1)
    return "\n".join(line[3:] for line in block.splitlines())


@pytest.fixture
def example(capsys):
    """The namespace of the documented example, run as written (its kind registered)."""
    namespace: dict = {}
    try:
        exec(compile(_documented_example(), str(WORKFLOWS), "exec"), namespace)
        yield namespace
    finally:
        if "TransposedLinear" in {kind.name for kind in panther_lite.conversion.kinds.registered_kinds()}:
            unregister_kind("TransposedLinear")


def _twin_linear_model(model: nn.Sequential) -> nn.Sequential:
    """The same function built from nn.Linear (weights transposed)."""
    twin = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    with torch.no_grad():
        for linear, own in ((twin[0], model[0]), (twin[2], model[2])):
            linear.weight.copy_(own.weight.t())
            linear.bias.copy_(own.bias)
    return twin


def _model(namespace, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    own = namespace["TransposedLinear"]
    model = nn.Sequential(own(64, 256), nn.GELU(), own(256, 64))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.bias.normal_()
    return model


def test_the_documented_example_converts_the_layers_like_their_nn_linear_twins(example):
    report = example["report"]
    assert list(report["kind"]) == ["TransposedLinear", "TransposedLinear"]
    assert list(report["status"]) == ["converted", "converted"]
    assert list(report["shape"]) == [(64, 256), (256, 64)]  # the layer's own (in, out) layout
    model, x = _model(example), torch.randn(256, 64)
    twin = _twin_linear_model(model)
    options = dict(param_ratio=0.4, allocation="global", calibration_data=[x[:128], x[128:]], progress=False)
    ours, theirs = panther_lite.convert(model, **options), panther_lite.convert(twin, **options)
    assert isinstance(model[0], example["SKTransposedLinear"]) and not isinstance(twin[0], example["SKTransposedLinear"])
    assert list(ours["low_rank"]) == list(theirs["low_rank"])
    assert ours["output_error"].tolist() == pytest.approx(theirs["output_error"].tolist(), rel=1e-4)
    torch.testing.assert_close(model(x), twin(x), rtol=1e-4, atol=1e-5)


def test_sequential_fits_and_all_linear_target_it(example):
    model, x = _model(example), torch.randn(256, 64)
    report = panther_lite.convert(
        model, target_modules="all-linear", param_ratio=0.5, sequential=True, calibration_data=[x], progress=False
    )
    assert list(report["init"]) == ["sequential", "sequential"]
    assert report["output_error"].between(0, 1).all()


def test_densify_gives_back_the_users_layer_computing_the_sketch(example):
    model, x = _model(example), torch.randn(32, 64)
    panther_lite.convert(model, param_ratio=0.5, calibration_data=[x], progress=False)
    sketched = model(x)
    panther_lite.densify(model)
    assert [type(m).__name__ for m in model] == ["TransposedLinear", "GELU", "TransposedLinear"]
    torch.testing.assert_close(model(x), sketched, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frozen", [False, True])
def test_configs_name_the_kind_and_rebuild_it_in_a_fresh_model(example, frozen):
    model, x = _model(example), torch.randn(32, 64)
    panther_lite.convert(model, param_ratio=0.5, calibration_data=[x], progress=False)
    if frozen:
        panther_lite.freeze(model)
        assert isinstance(model[0], FrozenLinear) and model[0].dense == "TransposedLinear"
    config = panther_lite.conversion_config(model)
    assert [(e["kind"], e["dense"], e["shape"]) for e in config["layers"]] == [
        ("SKLinear", "TransposedLinear", [64, 256]), ("SKLinear", "TransposedLinear", [256, 64])
    ]
    assert all(entry.get("frozen", False) == frozen for entry in config["layers"])
    fresh = _model(example, seed=1)
    panther_lite.apply_conversion_config(fresh, config)
    fresh.load_state_dict(model.state_dict())
    assert type(fresh[0]) is type(model[0])
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_without_its_kind_the_layer_is_no_candidate(example):
    unregister_kind("TransposedLinear")
    with pytest.raises(ValueError, match=r"no Linear/Conv1D/Conv1d/Conv2d/Conv3d/Experts module matched"):
        panther_lite.convert(_model(example), param_ratio=0.5, progress=False)


def test_registration_errors_are_named(example):
    kind_class, own = example["TransposedLinearKind"], example["TransposedLinear"]
    with pytest.raises(TypeError, match="LayerKind instance"):
        panther_lite.register_kind("TransposedLinear")
    with pytest.raises(ValueError, match="'TransposedLinear' is registered already; pass replace=True"):
        panther_lite.register_kind(kind_class("TransposedLinear", own, built_type=example["SKTransposedLinear"]))
    with pytest.raises(ValueError, match="builds SKTransposedLinear, which kind 'TransposedLinear' builds already"):
        panther_lite.register_kind(kind_class("Other", own, built_type=example["SKTransposedLinear"]))
    with pytest.raises(ValueError, match="builds SKLinear, which kind 'Linear' builds already"):
        panther_lite.register_kind(kind_class("Other", own))
    replacement = kind_class("TransposedLinear", own, built_type=example["SKTransposedLinear"])
    assert panther_lite.register_kind(replacement, replace=True) is replacement
    assert kind_of(own(4, 4)) is replacement


class PlainLinear(nn.Linear):
    """An nn.Linear subclass overriding forward with the same function (FalconLinear's case)."""

    def forward(self, x):
        return F.linear(x, self.weight) + self.bias


class SKPlainLinear(SKLinear):
    pass


def test_a_later_kind_for_a_linear_subclass_wins_over_the_built_in_one():
    model, x = nn.Sequential(PlainLinear(32, 64), nn.ReLU(), nn.Linear(64, 32)), torch.randn(64, 32)
    before = panther_lite.convert(nn.Sequential(*model), param_ratio=0.5, calibration_data=[x], progress=False)
    assert before["kind"][0] == "Linear" and before["status"][0] == "converted"  # the built-in kind verified it
    assert before["reason"][0].startswith("verified linear: PlainLinear.forward")
    panther_lite.register_kind(LinearKind("PlainLinear", PlainLinear, built_type=SKPlainLinear, overridden=()))
    try:
        report = panther_lite.convert(model, param_ratio=0.5, calibration_data=[x], progress=False)
    finally:
        unregister_kind("PlainLinear")
    assert list(report["kind"]) == ["PlainLinear", "Linear"] and list(report["status"]) == ["converted"] * 2
    assert isinstance(model[0], SKPlainLinear) and type(model[2]) is SKLinear
