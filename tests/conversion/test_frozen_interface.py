"""Frozen layers answer what code written for ``nn.Linear``/``nn.ConvNd`` reads (``bias``,
``stride``, ``padding``, ``dilation``, ``groups``, ``padding_mode``, ...), also after a
quantizer replaced their layers; ``convert`` leaves frozen pairs alone (and says so when nothing
else is left) and ``densify`` of a frozen model is a clear error that changes nothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion import FrozenConv1d, FrozenConv2d, FrozenConv3d, FrozenLinear, freeze
from panther_lite.nn import SKLinear

CONV_OPTIONS = [
    (nn.Conv1d, dict(stride=2, padding=1, dilation=1, bias=True)),
    (nn.Conv2d, dict(stride=1, padding="same", dilation=2, padding_mode="reflect", bias=True)),
    (nn.Conv3d, dict(stride=(1, 2, 1), padding=0, bias=False)),
]
CONV_ATTRIBUTES = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                   "padding_mode", "transposed", "output_padding")


@pytest.mark.parametrize("conv_class, options", CONV_OPTIONS, ids=["1d", "2d", "3d"])
def test_a_frozen_convolution_reads_like_the_dense_one(conv_class, options):
    torch.manual_seed(0)
    model = nn.Sequential(conv_class(3, 8, 3, **options))
    dense = model[0]
    panther_lite.convert(model, num_terms=1, low_rank=2)
    freeze(model)
    frozen = model[0]
    assert isinstance(frozen, (FrozenConv1d, FrozenConv2d, FrozenConv3d))
    assert {name: getattr(frozen, name) for name in CONV_ATTRIBUTES} == {
        name: getattr(dense, name) for name in CONV_ATTRIBUTES
    }
    if dense.bias is None:
        assert frozen.bias is None
    else:
        assert frozen.bias is frozen[1].bias and torch.equal(frozen.bias, dense.bias)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("bias", [True, False])
def test_a_frozen_linear_reads_like_the_dense_one_also_when_quantized(bias):
    torch.manual_seed(0)
    dense = nn.Linear(32, 16, bias=bias)
    model = nn.Sequential(dense)
    panther_lite.convert(model, num_terms=1, low_rank=2)
    freeze(model)
    frozen = model[0]
    assert isinstance(frozen, FrozenLinear)
    assert (frozen.in_features, frozen.out_features) == (dense.in_features, dense.out_features)
    assert frozen.weight.shape == dense.weight.shape
    assert frozen.bias is frozen[1].bias and (frozen.bias is None) is not bias
    if bias:
        assert torch.equal(frozen.bias, dense.bias)
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        assert torch.equal(quantized[0].bias, dense.bias)  # the quantized layer's bias() method, called


def _frozen_beside_dense() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 16))
    panther_lite.convert(model, num_terms=1, low_rank=2, target_modules=["0", "2"])
    return freeze(model)


def test_convert_after_freeze_leaves_the_frozen_pairs_and_converts_the_rest():
    model, x = _frozen_beside_dense(), torch.randn(8, 16)
    frozen = [model[0], model[2]]
    report = panther_lite.convert(model, param_ratio=0.5, calibration_data=[x], progress=False)
    assert report["name"].tolist() == ["3"] and isinstance(model[3], SKLinear)
    assert [model[0], model[2]] == frozen
    with pytest.raises(ValueError, match=r"the model holds 2 frozen layers \('0', '2'\), which convert does not"):
        panther_lite.convert(model, param_ratio=0.5, progress=False)
    with pytest.raises(ValueError, match="holds 2 frozen layers"):
        panther_lite.convert(model, param_ratio=0.5, progress=False, target_modules=["0.0"])


def test_densify_of_a_frozen_model_is_refused_and_changes_nothing(assert_unchanged):
    model = _frozen_beside_dense()
    panther_lite.convert(model, num_terms=1, low_rank=2, target_modules=["3"])
    state, types = {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"densify: the model holds 2 frozen layers \('0', '2'\); freeze is one-way"):
        panther_lite.densify(model)
    assert_unchanged(model, state, types)
