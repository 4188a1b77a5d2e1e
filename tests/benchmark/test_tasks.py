"""The digits task: one seeded split, models that are dense or sketched where asked and
seeded without the global random state, a training loop that learns, and accuracy."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    accuracy,
    cnn_classifier,
    digits_task_accuracy,
    load_digits_split,
    mlp_classifier,
    train_classifier,
)
from panther_lite.nn import SKConv2d, SKLinear


def test_load_digits_split_is_a_seeded_partition():
    train, test = load_digits_split(test_fraction=0.25, seed=0)
    assert train.x.shape == (1797 - 449, 64) and test.x.shape == (449, 64) and test.y.dtype == torch.long
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    again_train, _ = load_digits_split(seed=0)
    assert torch.equal(again_train.x, train.x)
    other_train, _ = load_digits_split(seed=1)
    assert not torch.equal(other_train.y, train.y)
    other_test_fraction, _ = load_digits_split(test_fraction=0.5, seed=0)
    assert len(other_test_fraction.y) == 1797 - 898
    from sklearn.datasets import load_digits

    every_label = torch.bincount(torch.tensor(load_digits().target))
    assert torch.equal(torch.bincount(torch.cat([train.y, test.y])), every_label)  # each sample once
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(test_fraction=1.0)


def test_mlp_classifier_sketches_every_layer_but_the_head_by_default():
    model = mlp_classifier([12, 40, 40, 3], num_terms=1, low_rank=2)
    assert [type(m) for m in model] == [SKLinear, nn.ReLU, SKLinear, nn.ReLU, nn.Linear]
    assert [m.seed for m in model if isinstance(m, SKLinear)] == [0, 1]
    middle_only = mlp_classifier([12, 40, 40, 3], num_terms=1, low_rank=2, sketched=[1], seed=5)
    assert [type(m) for m in middle_only][::2] == [nn.Linear, SKLinear, nn.Linear] and middle_only[2].seed == 5
    assert all(isinstance(m, (nn.Linear, nn.ReLU)) for m in mlp_classifier([12, 40, 3]))
    with pytest.raises(ValueError, match="both num_terms and low_rank"):
        mlp_classifier([4, 4], num_terms=1)
    with pytest.raises(ValueError, match="at least an input and an output"):
        mlp_classifier([4])


def test_models_are_seeded_without_touching_the_global_random_state(monkeypatch):
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)  # torch.manual_seed would call it
    state = torch.random.get_rng_state()
    first, second = mlp_classifier([8, 6, 2], seed=3), mlp_classifier([8, 6, 2], seed=3)
    assert torch.equal(first[0].weight, second[0].weight)
    assert not torch.equal(first[0].weight, mlp_classifier([8, 6, 2], seed=4)[0].weight)
    cnn = cnn_classifier(4, num_terms=1, low_rank=2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state) and reseeded == []
    assert isinstance(cnn[3], SKConv2d) and cnn(torch.rand(5, 64)).shape == (5, 10)


def test_train_classifier_learns_the_digits_reproducibly():
    train, test = load_digits_split(seed=0)
    model = mlp_classifier([64, 32, 32, 10], seed=0)
    losses = train_classifier(model, train, epochs=4, seed=0)
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert not model.training and accuracy(model, test) > 0.75  # chance: 0.1
    again = mlp_classifier([64, 32, 32, 10], seed=0)
    assert train_classifier(again, train, epochs=4, seed=0) == losses
    with pytest.raises(ValueError, match="epochs"):
        train_classifier(model, train, epochs=0)


def test_train_classifier_leaves_frozen_parameters_alone():
    train, _ = load_digits_split(seed=0)
    model = mlp_classifier([64, 16, 10], seed=0)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.clone()
    train_classifier(model, train, epochs=1, weight_decay=1.0)
    assert torch.equal(model[0].weight, frozen)


def test_digits_task_accuracy_learns_and_is_reproducible():
    dense = digits_task_accuracy("linear", width=32, epochs=4, seed=0)
    assert dense > 0.75  # chance: 0.1
    assert digits_task_accuracy("linear", width=32, epochs=4, seed=0) == dense
    sketched = digits_task_accuracy("conv2d", 1, 2, width=8, epochs=2, seed=0)
    assert 0.0 <= sketched <= 1.0
    with pytest.raises(ValueError, match="both num_terms and low_rank"):
        digits_task_accuracy("linear", 1, None)
    with pytest.raises(ValueError, match="layer"):
        digits_task_accuracy("attention")
