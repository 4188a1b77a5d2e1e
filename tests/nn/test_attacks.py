"""Inputs a user gets wrong, or runs the layers on unusual devices: each ends in a correct
result or an error naming the argument (found by an adversarial pass over the layers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from panther_lite.nn import SKConv1d, SKConv2d, SKConv3d, SKLinear

CONVS = [(SKConv1d, nn.Conv1d, 1), (SKConv2d, nn.Conv2d, 2), (SKConv3d, nn.Conv3d, 3)]


@pytest.mark.parametrize("sketched, dense, dims", CONVS, ids=["1d", "2d", "3d"])
def test_convolutions_run_on_the_meta_device(sketched, dense, dims):
    """Shape inference on meta tensors (autocast has no meta backend to ask about)."""
    layer = sketched(8, 16, 3, stride=2, padding=1, num_terms=1, low_rank=2, device="meta")
    reference = dense(8, 16, 3, stride=2, padding=1, device="meta")
    x = torch.empty(2, 8, *(9,) * dims, device="meta")
    out = layer(x)
    assert out.is_meta and out.shape == reference(x).shape


@pytest.mark.parametrize(
    "layer",
    [SKLinear(16, 12, 1, 1), SKConv1d(4, 3, 3, num_terms=1, low_rank=1), SKConv2d(4, 3, 3, num_terms=1, low_rank=1)],
    ids=["linear", "conv1d", "conv2d"],
)
@pytest.mark.parametrize("value", [[1.0, 2.0, 3.0, 4.0], np.ones((2, 4, 5, 5), dtype=np.float32), 1.5])
def test_a_non_tensor_input_is_a_type_error_naming_it(layer, value):
    with pytest.raises(TypeError, match="input must be a Tensor, got"):
        layer(value)


@pytest.mark.parametrize(
    "build",
    [
        lambda: SKLinear.from_linear(nn.LazyLinear(4), 1, 2),
        lambda: SKConv2d.from_conv2d(nn.LazyConv2d(4, 3), 1, 2),
        lambda: SKConv3d.from_conv3d(nn.LazyConv3d(4, 3), 1, 2),
        lambda: SKLinear(16, 12, 1, 1, W_init=nn.LazyLinear(12).weight),
        lambda: SKConv2d(3, 4, 3, layer=nn.LazyConv2d(4, 3)),
        lambda: SKLinear(16, 12, 1, 1).initialize_from_weight(nn.LazyLinear(12).weight),
    ],
    ids=["linear", "conv2d", "conv3d", "W_init", "layer", "initialize_from_weight"],
)
def test_a_lazy_module_is_refused_with_what_to_do(build):
    with pytest.raises(ValueError, match="uninitialized parameter of a lazy module.*run a forward pass"):
        build()


@pytest.mark.parametrize("cls", [SKLinear, SKConv2d])
def test_empty_batches_give_empty_outputs_and_gradients(cls):
    layer = cls(16, 12, num_terms=1, low_rank=2) if cls is SKLinear else cls(16, 12, 3, num_terms=1, low_rank=2)
    x = torch.randn(0, 16, requires_grad=True) if cls is SKLinear else torch.randn(0, 16, 5, 5, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape[0] == 0 and x.grad.shape == x.shape
    assert torch.count_nonzero(layer.bias.grad) == 0
    if cls is SKLinear:
        assert layer(torch.randn(2, 0, 16)).shape == (2, 0, 12)  # a zero-length sequence


def test_weight_read_after_optimizer_steps_is_the_current_effective_weight():
    """Fused Adam does not bump version counters: the read-only weight must not go stale."""
    torch.manual_seed(0)
    layer = SKLinear(32, 24, 2, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=True)
    with torch.no_grad():
        before = layer.weight.clone()
    for _ in range(2):
        layer(torch.randn(4, 32)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(layer.weight, layer.effective_weight(), rtol=0, atol=0)
    assert not torch.equal(before, layer.effective_weight().detach())
