"""Memory: parameter counts and bytes once per storage, activations saved for backward,
and the training-forward footprint."""
from __future__ import annotations

import torch
import torch.nn as nn
import pytest

from panther_lite.benchmark import (
    anchor_linear,
    count_parameters,
    parameter_bytes,
    saved_activation_bytes,
    training_memory_bytes,
)
from panther_lite.nn import SketchSize, SKLinear


def test_parameter_bytes_counts_parameters_and_buffers_once_per_storage():
    linear = nn.Linear(10, 7)
    assert parameter_bytes(linear) == (70 + 7) * 4
    norm = nn.BatchNorm1d(5, dtype=torch.float64)  # weight, bias, running mean/var: 8 bytes each; count: int64
    assert parameter_bytes(norm) == 4 * 5 * 8 + 8
    tied = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    tied[1].weight = tied[0].weight
    assert parameter_bytes(tied) == 36 * 4
    layer = SKLinear(40, 30, 2, 3, seed=0)
    assert parameter_bytes(layer) == 4 * layer.parameter_counts().stored


def test_count_parameters_separates_trainable_from_stored():
    model = nn.Sequential(SKLinear(12, 8, 1, 2, seed=0), nn.ReLU(), nn.Linear(8, 3))
    counts = count_parameters(model)
    sketched = model[0].parameter_counts()
    assert counts.trainable == sketched.trainable + 8 * 3 + 3
    assert counts.stored == sketched.stored + 8 * 3 + 3
    assert count_parameters(nn.Linear(4, 2)) == SketchSize(trainable=10, stored=10)


def test_saved_activation_bytes_of_known_ops():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert saved_activation_bytes(lambda: torch.exp(x)) == 15 * 8  # exp saves its output
    assert saved_activation_bytes(lambda: x * x) == 15 * 8  # x saved twice, one storage
    assert saved_activation_bytes(lambda: x.t() * x.t()) == 15 * 8  # views share x's storage
    assert saved_activation_bytes(lambda: x.sum()) == 0
    assert saved_activation_bytes(lambda: torch.exp(x), exclude=[x.detach()]) == 15 * 8
    assert saved_activation_bytes(lambda: x * 2.0 * x, exclude=[x]) == 15 * 8  # only x*2.0 counts
    with torch.no_grad():
        assert saved_activation_bytes(lambda: torch.exp(x)) == 0


def test_saved_activation_bytes_of_dense_and_sketched_linear():
    x = torch.randn(6, 10, requires_grad=True)
    dense = nn.Linear(10, 7)
    assert saved_activation_bytes(lambda: dense(x), list(dense.parameters())) == x.numel() * 4
    layer = SKLinear(10, 7, 1, 2, seed=0)
    tensors = list(layer.parameters()) + list(layer.buffers())
    # x and the batch × Lk activation x·U2; the factors and sketches are excluded
    assert saved_activation_bytes(lambda: layer(x), tensors) == (6 * 10 + 6 * 2) * 4
    assert training_memory_bytes(layer, x) == parameter_bytes(layer) + (6 * 10 + 6 * 2) * 4


def test_anchor_formulation_saves_per_term_outputs():
    """The per-term formulation keeps L-sized temporaries that the layer avoids."""
    layer = SKLinear(32, 32, 4, 2, seed=0)
    x = torch.randn(8, 32, requires_grad=True)
    tensors = list(layer.parameters()) + list(layer.buffers())
    sketched = saved_activation_bytes(lambda: layer(x), tensors)
    per_term = saved_activation_bytes(lambda: anchor_linear(layer)(x), tensors)
    assert per_term > sketched


@pytest.mark.cuda
def test_training_memory_on_cuda_includes_parameters_and_activations():
    layer = nn.Linear(256, 256, device="cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    assert training_memory_bytes(layer, x) >= parameter_bytes(layer) + 128 * 256 * 4
