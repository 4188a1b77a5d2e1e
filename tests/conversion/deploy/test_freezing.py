"""panther_lite.freeze: every sketched layer becomes a pair of standard layers computing the same
function (same stored size, shared layers stay shared), which the ecosystem's quantizers
(quantize_dynamic, torchao int8 weight-only and dynamic int8), torch.compile and torch.export
handle; the frozen model saves and reloads; a quantizer that skipped sketched layers is flagged."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import panther_lite
from panther_lite.conversion import FrozenConv1d, FrozenConv2d, FrozenConv3d, FrozenLinear, freeze
from panther_lite.conversion.surgery import stored_numel
from panther_lite.nn import SKConv1d, SKConv2d, SKConv3d, SKLinear

MIN_COSINE = 0.99


class ConvNet(nn.Module):
    """1-d, 2-d and 3-d sketched convolutions (strides, dilation, 'same', reflect) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = SKConv1d(3, 8, 3, stride=2, padding=1, num_terms=1, low_rank=2, seed=0)
        self.c2 = SKConv2d(3, 8, 3, padding="same", dilation=2, num_terms=1, low_rank=2, seed=1, padding_mode="reflect")
        self.c3 = SKConv3d(3, 8, 2, stride=(1, 2, 1), padding=0, num_terms=1, low_rank=2, seed=2, bias=False)
        self.head = SKLinear(24, 5, num_terms=1, low_rank=2, seed=3)

    def forward(self, x1, x2, x3):
        pooled = [self.c1(x1).mean(-1), self.c2(x2).mean((-2, -1)), self.c3(x3).mean((-3, -2, -1))]
        return self.head(torch.cat(pooled, dim=1))


def conv_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 11, generator=g, dtype=dtype), torch.randn(2, 3, 7, 9, generator=g, dtype=dtype),
            torch.randn(2, 3, 4, 6, 5, generator=g, dtype=dtype))


def converted_mlp() -> nn.Sequential:
    """A float32 MLP converted at rank 2Lk = 16 (what the quantizers are tried on)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    panther_lite.convert(model, num_terms=2, low_rank=4)
    return model.eval()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def test_frozen_convolutions_and_linear_compute_the_same_function():
    model = ConvNet().double().eval()
    inputs = conv_inputs()
    with torch.no_grad():
        expected = model(*inputs)
        kernels = [getattr(model, name).effective_weight() for name in ("c1", "c2", "c3")]
    stored = stored_numel(model)
    assert freeze(model) is model
    assert [type(model.c1), type(model.c2), type(model.c3), type(model.head)] == [
        FrozenConv1d, FrozenConv2d, FrozenConv3d, FrozenLinear]
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), expected, rtol=1e-12, atol=1e-12)
    assert stored_numel(model) == stored  # the sketches folded in: no more, no fewer values
    with torch.no_grad():  # the read-only weight code written for dense layers reads
        for name, kernel in zip(("c1", "c2", "c3"), kernels):
            torch.testing.assert_close(getattr(model, name).weight, kernel, rtol=1e-12, atol=1e-12)
    assert model.c2[0].padding_mode == "reflect" and model.c2[0].dilation == (2, 2) and model.c3[1].bias is None
    assert not any(isinstance(m, (SKLinear, SKConv1d, SKConv2d, SKConv3d)) for m in model.modules())


def test_frozen_linear_is_two_linear_layers_of_width_2Lk():
    layer = SKLinear(64, 32, num_terms=3, low_rank=2, seed=0, dtype=torch.float64)
    model = nn.Sequential(layer)
    x = torch.randn(5, 7, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = layer(x)
    frozen = freeze(model)[0]
    assert isinstance(frozen[0], nn.Linear) and isinstance(frozen[1], nn.Linear)
    assert frozen[0].weight.shape == (12, 64) and frozen[0].bias is None
    assert frozen[1].weight.shape == (32, 12) and frozen[1].bias is not None
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), expected, rtol=1e-12, atol=1e-12)
        # the reference: the effective weight applied by F.linear
        torch.testing.assert_close(frozen(x), F.linear(x, layer.effective_weight(), layer.bias), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(frozen.weight, layer.effective_weight(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frozen_linear_matches_at_each_dtype(dtype):
    layer = SKLinear(48, 24, num_terms=2, low_rank=2, seed=0, init="svd", dtype=dtype)
    x = torch.randn(6, 48, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        frozen = freeze(nn.Sequential(layer))[0]
        assert frozen[0].weight.dtype == dtype
        tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(frozen(x), expected, rtol=tolerance, atol=tolerance)


def test_freeze_keeps_shared_layers_shared_and_training_state():
    layer = SKLinear(8, 8, num_terms=1, low_rank=1, seed=0)
    layer.S1.requires_grad_(False)
    layer.S2.requires_grad_(False)
    layer.bias.requires_grad_(False)
    model = nn.ModuleDict({"a": layer, "b": layer}).train()
    freeze(model)
    assert model["a"] is model["b"] and isinstance(model["a"], FrozenLinear)
    assert model["a"].training and not any(p.requires_grad for p in model.parameters())


def test_freeze_bad_input_is_a_clear_error_and_no_sketched_layer_is_a_no_op():
    with pytest.raises(TypeError, match="nn.Module"):
        freeze("model")
    with pytest.raises(ValueError, match="root module"):
        freeze(SKLinear(4, 4, 1, 1, seed=0))
    dense = nn.Sequential(nn.Linear(4, 4))
    before = dense[0]
    assert freeze(dense)[0] is before


def test_quantize_dynamic_quantizes_two_linear_per_sketched_layer():
    model = converted_mlp()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    sketched = [name for name, m in model.named_modules() if isinstance(m, SKLinear)]
    assert sketched
    quantized = torch.ao.quantization.quantize_dynamic(freeze(model), {nn.Linear}, dtype=torch.qint8)
    dynamic_linear = torch.ao.nn.quantized.dynamic.Linear
    for name in sketched:
        pair = quantized.get_submodule(name)
        assert isinstance(pair, FrozenLinear) and all(isinstance(m, dynamic_linear) for m in pair)
    with torch.no_grad():
        assert cosine(quantized(x), expected) >= MIN_COSINE


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"])
def test_torchao_int8_quantizes_the_frozen_layers(config_name):
    quantization = pytest.importorskip("torchao.quantization")
    model = converted_mlp()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    freeze(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's notes on its own deprecations
        quantization.quantize_(model, getattr(quantization, config_name)())
    linears = [m for pair in model.modules() if isinstance(pair, FrozenLinear) for m in pair]
    assert len(linears) == 4
    assert all(type(m.weight).__module__.startswith("torchao") for m in linears)
    with torch.no_grad():
        assert cosine(model(x), expected) >= MIN_COSINE


def test_a_quantizer_that_skipped_sketched_layers_is_reported():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    panther_lite.convert(model, target_modules=["2"], num_terms=1, low_rank=2)
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear})
    assert isinstance(quantized[2], SKLinear)  # what the issue reports: skipped silently by the quantizer
    with pytest.warns(UserWarning, match=r"sketched layers \(2\) that the quantizer skipped.*panther_lite.freeze"):
        freeze(quantized)
    requantized = torch.ao.quantization.quantize_dynamic(quantized, {nn.Linear})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen, then quantized: nothing left to report
        freeze(requantized)
    assert isinstance(requantized[2][1], torch.ao.nn.quantized.dynamic.Linear)


def test_save_pretrained_warns_about_sketched_layers_beside_quantized_ones(tmp_path):
    pytest.importorskip("safetensors")
    torchao = pytest.importorskip("torchao.quantization")

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    panther_lite.convert(model, target_modules=["2"], num_terms=1, low_rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    with pytest.warns(UserWarning, match=r"save_pretrained: the model holds quantized modules \(0, 1 in all\)"):
        with pytest.raises(ValueError, match=r"entries \['0.weight'\] are not \(quantized modules: 0\)"):
            panther_lite.save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_save_pretrained_of_a_quantize_dynamic_model_is_refused_before_writing(tmp_path):
    pytest.importorskip("safetensors")
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    panther_lite.convert(model, num_terms=1, low_rank=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation note
        quantized = torch.ao.quantization.quantize_dynamic(freeze(model), {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ValueError, match=r"_packed_params.*save the float model before quantizing"):
        panther_lite.save_pretrained(quantized, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_frozen_model_round_trips_through_save_and_from_pretrained(tmp_path):
    pytest.importorskip("safetensors")

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 32), nn.ReLU(), nn.Linear(32, 4))

    model = build().eval()
    panther_lite.convert(model, target_modules=["0", "3"], num_terms=1, low_rank=2)
    freeze(model)
    config = panther_lite.conversion_config(model)
    assert [(e["name"], e["kind"], e["frozen"]) for e in config["layers"]] == [
        ("0", "SKConv2d", True), ("3", "SKLinear", True)]
    panther_lite.save_pretrained(model, tmp_path / "saved")
    loaded = panther_lite.from_pretrained(build, tmp_path / "saved").eval()
    assert isinstance(loaded[0], FrozenConv2d) and isinstance(loaded[3], FrozenLinear)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_config_rejects_a_non_boolean_frozen_field():
    model = nn.Sequential(nn.Linear(8, 8))
    config = dict(format="panther_lite.conversion", version=1, layers=[dict(
        name="0", kind="SKLinear", dense="Linear", shape=[8, 8], num_terms=1, low_rank=1, bias=True, frozen="yes")])
    with pytest.raises(ValueError, match="'frozen' must be true or false"):
        panther_lite.apply_conversion_config(model, config)
    assert isinstance(model[0], nn.Linear)


def test_frozen_model_compiles_and_exports():
    model = freeze(converted_mlp())
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="eager")(x), expected)
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), expected)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("panther_lite" in target for target in targets)
