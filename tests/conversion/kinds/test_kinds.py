"""Layer kinds: transformers' Conv1D (GPT-2) converts like nn.Linear, and nn.Conv1d /
nn.Conv3d like nn.Conv2d, through convert, densify and conversion configs."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from panther_lite import apply_conversion_config, conversion_config, convert, densify
from panther_lite.nn import SKConv1d, SKConv3d, SKLinear

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def low_rank_(weight, rank, generator):
    """Overwrite ``weight`` with a random matrix of ``rank`` (a layer a rank-``rank`` sketch fits exactly)."""
    rows, columns = weight.shape[0], weight[0].numel()
    left = torch.randn(rows, rank, generator=generator, dtype=torch.float64)
    right = torch.randn(rank, columns, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        weight.copy_((left @ right).view_as(weight))


def gpt2_mlp():
    """GPT-2's MLP layout: Conv1D(nf=out, nx=in) layers, weights stored (in, out), rank 4."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(Conv1D(24, 16), nn.GELU(), Conv1D(16, 24)).double()
    for layer in (model[0], model[2]):
        low_rank_(layer.weight, 4, generator)
        layer.bias.data.normal_(generator=generator)
    return model


def test_conv1d_converts_to_sklinear_of_the_transposed_weight():
    model = gpt2_mlp()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    expected = model(x)
    report = convert(model, target_modules="all-linear", num_terms=1, low_rank=2, progress=False)
    assert list(report["kind"]) == ["Conv1D", "Conv1D"]
    assert list(report["status"]) == ["converted", "converted"]
    assert list(report["shape"]) == [(16, 24), (24, 16)]  # the Conv1D's own (in, out) layout
    assert isinstance(model[0], SKLinear) and (model[0].in_features, model[0].out_features) == (16, 24)
    assert report["weight_error"].max() < 1e-10  # rank 4 = 2Lk: an exact fit
    torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-10)


def test_conv1d_and_linear_with_the_same_weights_convert_alike():
    conv1d_model = gpt2_mlp()
    linear_model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16)).double()
    with torch.no_grad():
        for linear, conv in ((linear_model[0], conv1d_model[0]), (linear_model[2], conv1d_model[2])):
            linear.weight.copy_(conv.weight.t())
            linear.bias.copy_(conv.bias)
    x = torch.randn(64, 16, dtype=torch.float64)
    reports = [
        convert(model, param_ratio=0.5, rank_pattern={"0": (1, 1)}, calibration_data=[x[:32], x[32:]], progress=False)
        for model in (conv1d_model, linear_model)
    ]
    for column in ("num_terms", "low_rank", "stored_params", "weight_error", "output_error"):
        assert reports[0][column].tolist() == pytest.approx(reports[1][column].tolist(), rel=1e-9), column
    assert list(reports[0]["init"]) == ["calibrated", "calibrated"]
    torch.testing.assert_close(conv1d_model(x), linear_model(x), rtol=1e-9, atol=1e-12)


def test_densify_gives_back_a_conv1d_or_a_linear_without_transformers(monkeypatch):
    model = gpt2_mlp()
    convert(model, num_terms=1, low_rank=1, progress=False)
    x = torch.randn(3, 16, dtype=torch.float64)
    sketched_out = model(x)
    as_linear = densify(_copy_of(model, monkeypatch))
    assert [type(m) for m in as_linear] == [nn.Linear, nn.GELU, nn.Linear]
    densify(model)
    assert [type(m) for m in model] == [Conv1D, nn.GELU, Conv1D]
    assert model[0].weight.shape == (16, 24) and model[0].weight.dtype == torch.float64
    for dense in (model, as_linear):
        torch.testing.assert_close(dense(x), sketched_out, rtol=1e-12, atol=1e-12)


def _copy_of(model, monkeypatch):
    """A deep copy of ``model`` densified while transformers cannot be imported."""
    duplicate = copy.deepcopy(model)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "transformers.pytorch_utils", None)  # import now raises ImportError
        return densify(duplicate)


def test_conv1d_layout_survives_a_saved_config():
    model = gpt2_mlp()
    convert(model, num_terms=1, low_rank=2, progress=False)
    config = conversion_config(model)
    assert [(c["kind"], c["dense"], c["shape"]) for c in config["layers"]] == [
        ("SKLinear", "Conv1D", [16, 24]), ("SKLinear", "Conv1D", [24, 16])
    ]
    fresh = apply_conversion_config(nn.Sequential(Conv1D(24, 16), nn.GELU(), Conv1D(16, 24)).double(), config)
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    assert [type(m) for m in densify(fresh)] == [Conv1D, nn.GELU, Conv1D]


def test_gpt2_projections_are_candidates():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    tokens = torch.randint(0, 64, (2, 6))
    report = convert(model, target_modules="all-linear", num_terms=1, low_rank=2, example_inputs=tokens,
                     progress=False).set_index("name")
    conv1d = [name for name in report.index if report.loc[name, "kind"] == "Conv1D"]
    assert conv1d == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                      "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert (report.loc[conv1d, "status"] == "converted").all()
    assert "tied to transformer.wte.weight" in report.loc["lm_head", "reason"]
    assert model(tokens).logits.shape == (2, 6, 64)


def test_detecting_conv1d_does_not_import_transformers():
    code = (
        "import sys, torch.nn as nn, panther_lite\n"
        "panther_lite.convert(nn.Sequential(nn.Linear(16, 16)), num_terms=1, low_rank=2, progress=False)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- Conv1d / Conv3d

CONV_OPTIONS = [
    dict(padding=1),
    dict(padding="same", padding_mode="reflect"),
    dict(padding=2, stride=2, dilation=2, padding_mode="circular"),
    dict(padding="valid", bias=False),
    dict(padding=1, padding_mode="replicate", stride=(1, 2, 1)),
]


def conv_case(dims, options):
    """A float64 nn.Conv{dims}d with ``options`` and a batch for it."""
    options = dict(options)
    stride = options.pop("stride", 1)
    if isinstance(stride, tuple):
        stride = stride[:dims]
    conv_class = {1: nn.Conv1d, 3: nn.Conv3d}[dims]
    torch.manual_seed(dims)
    conv = conv_class(3, 8, 3, stride=stride, dtype=torch.float64, **options)
    x = torch.randn(5, 3, *([7] * dims), dtype=torch.float64)
    return conv, x


@pytest.mark.parametrize("dims", [1, 3])
@pytest.mark.parametrize("options", CONV_OPTIONS)
def test_conv_nd_output_error_matches_the_convolution_outputs(dims, options):
    conv, x = conv_case(dims, options)
    reference = nn.Sequential(conv)
    model = copy.deepcopy(reference)
    report = convert(model, num_terms=1, low_rank=2, calibration_data=[x[:2], x[2:]], progress=False)
    assert report.loc[0, "kind"] == f"Conv{dims}d" and report.loc[0, "init"] == "calibrated"
    assert isinstance(model[0], {1: SKConv1d, 3: SKConv3d}[dims])
    with torch.no_grad():
        diff = model(x) - reference(x)
        bias = 0 if conv.bias is None else conv.bias.view(-1, *([1] * dims))
        signal = reference(x) - bias
    assert report.loc[0, "output_error"] == pytest.approx((diff.norm() / signal.norm()).item(), rel=1e-9)


def _conv_args(conv):
    return dict(in_channels=conv.in_channels, out_channels=conv.out_channels, kernel_size=conv.kernel_size,
                stride=conv.stride, padding=conv.padding, dilation=conv.dilation, bias=conv.bias is not None,
                padding_mode=conv.padding_mode)


@pytest.mark.parametrize("dims", [1, 3])
def test_conv_nd_round_trips_through_densify_and_config(dims):
    conv, x = conv_case(dims, dict(padding=1))

    def build(first):
        return nn.Sequential(first, nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7**dims, 4)).double()

    model = build(conv)
    report = convert(model, target_modules=["0"], num_terms=1, low_rank=2, progress=False)
    assert report.loc[0, "status"] == "converted"
    config = conversion_config(model)
    assert config["layers"][0]["kind"] == f"SKConv{dims}d" and config["layers"][0]["dense"] == f"Conv{dims}d"
    fresh = apply_conversion_config(build(type(conv)(**_conv_args(conv))), config)
    fresh.load_state_dict(model.state_dict())
    sketched_out = model(x)
    torch.testing.assert_close(fresh(x), sketched_out, rtol=0, atol=0)
    densify(model)
    assert type(model[0]) is type(conv)
    torch.testing.assert_close(model(x), sketched_out, rtol=1e-12, atol=1e-12)


def test_converted_conv1d_keeps_its_weight_layout_for_code_reading_it():
    model = gpt2_mlp()
    convert(model, num_terms=1, low_rank=2, progress=False)
    layer = model[0]
    assert layer.weight.shape == (16, 24)  # Conv1D's (in, out)
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(torch.addmm(layer.bias, x, layer.weight), layer(x), rtol=1e-12, atol=1e-12)
    with torch.device("meta"):
        skeleton = nn.Sequential(Conv1D(24, 16), nn.GELU(), Conv1D(16, 24))
    apply_conversion_config(skeleton, conversion_config(model))
    assert type(skeleton[0]) is type(layer) and skeleton[0].S1.is_meta
