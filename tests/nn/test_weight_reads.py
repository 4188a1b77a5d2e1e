"""The read-only ``weight`` of sketched layers reads like ``nn.Linear``'s: never aliases the
layer's cache, never serves a value computed under another autocast state, and has the
parameter dtype under autocast (T5's ``x.to(self.wo.weight.dtype)``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from panther_lite.nn import SKConv2d, SKLinear


def layers():
    torch.manual_seed(0)
    return [SKLinear.from_linear(nn.Linear(16, 12), 1, 2), SKConv2d.from_conv2d(nn.Conv2d(3, 4, 3), 1, 2)]


@pytest.mark.parametrize("layer", layers(), ids=["linear", "conv2d"])
@pytest.mark.parametrize("write", [lambda w: w.data.mul_(0), lambda w: w.mul_(0), lambda w: w.data.copy_(w + 1)])
def test_writing_into_a_read_weight_changes_neither_the_layer_nor_later_reads(layer, write):
    with torch.no_grad():
        want = layer.effective_weight().clone()
        write(layer.weight)
        torch.testing.assert_close(layer.weight, want, rtol=0, atol=0)
        torch.testing.assert_close(layer.effective_weight(), want, rtol=0, atol=0)


@pytest.mark.parametrize("grad", [False, True])
def test_weight_under_autocast_has_the_parameter_dtype_and_values(grad):
    layer = layers()[0]
    dense = nn.Linear(16, 12)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        inside, dense_dtype = layer.weight, dense.weight.dtype
    assert inside.dtype == dense_dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(inside.detach(), layer.effective_weight(), rtol=0, atol=0)


def test_a_read_under_autocast_is_not_served_outside_it():
    layer = layers()[0]
    with torch.no_grad():
        want = layer.effective_weight().clone()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer.weight
        after = layer.weight
    assert after.dtype == torch.float32
    torch.testing.assert_close(after, want, rtol=0, atol=0)


def test_repeated_reads_compute_the_product_once(monkeypatch):
    layer = layers()[0]
    calls = []
    original = SKLinear.effective_weight
    monkeypatch.setattr(SKLinear, "effective_weight", lambda self: calls.append(1) or original(self))
    with torch.no_grad():
        first, second = layer.weight, layer.weight
        assert first is not second and torch.equal(first, second) and len(calls) == 1
        layer.S1.mul_(2)
        torch.testing.assert_close(layer.weight, original(layer), rtol=0, atol=0)
    assert len(calls) == 2
