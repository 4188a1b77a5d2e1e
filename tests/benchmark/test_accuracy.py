"""Accuracy helpers and the anchor's formulation: trained-like weights have the asked
spectrum and norm, and the per-term formulations equal the layers in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    anchor_conv2d,
    anchor_linear,
    ignore_size_warnings,
    relative_output_error,
    structured_weight,
)
from panther_lite.nn import SKConv2d, SKLinear


def test_structured_weight_has_the_decaying_spectrum_and_linear_init_norm():
    weight = structured_weight(40, 30, decay=1.0, seed=3, dtype=torch.float64)
    assert weight.shape == (40, 30)
    sigma = torch.linalg.svdvals(weight)
    torch.testing.assert_close(sigma / sigma[0], 1.0 / torch.arange(1, 31, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.norm() ** 2, torch.tensor(40 / 3, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(weight, structured_weight(40, 30, seed=3, dtype=torch.float64), rtol=0, atol=0)
    assert not torch.equal(weight, structured_weight(40, 30, seed=4, dtype=torch.float64))


@pytest.mark.parametrize("decay", [-1.0, float("nan"), float("inf"), "1"])
def test_structured_weight_rejects_a_bad_decay(decay):
    with pytest.raises(ValueError, match="decay"):
        structured_weight(4, 4, decay=decay)


def test_relative_output_error_of_known_functions():
    x = torch.randn(5, 4, dtype=torch.float64)
    assert relative_output_error(lambda v: 1.1 * v, lambda v: v, x) == pytest.approx(0.1, rel=1e-12)
    assert relative_output_error(lambda v: v, lambda v: v, x) == 0.0


def test_anchor_linear_equals_the_layer_in_float64():
    layer = SKLinear(40, 33, num_terms=3, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(7, 40, dtype=torch.float64)
    torch.testing.assert_close(anchor_linear(layer)(x), layer(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="batch, in"):
        anchor_linear(layer)(x[None])


def test_anchor_conv2d_equals_the_layer_in_float64():
    layer = SKConv2d(8, 16, 3, stride=2, padding=1, num_terms=2, low_rank=2, dtype=torch.float64, seed=0)
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(anchor_conv2d(layer)(x), layer(x), rtol=1e-12, atol=1e-12)


def test_the_anchor_conv2d_computes_the_layer_with_same_padding_and_channels_last():
    dense = nn.Conv2d(4, 4, 3, padding="same", dtype=torch.float64)
    with ignore_size_warnings():  # 2 terms on 4 channels store more than the dense kernel
        layer = SKConv2d.from_conv2d(dense, 2, 1, init="sketch", seed=0).to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 7, 7, dtype=torch.float64).to(memory_format=torch.channels_last)
    torch.testing.assert_close(anchor_conv2d(layer)(x), layer(x), rtol=1e-12, atol=1e-12)
