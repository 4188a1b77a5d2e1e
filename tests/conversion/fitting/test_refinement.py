"""Block-wise refinement of a converted block to the original block's outputs
(panther_lite.conversion.fitting.refinement)."""
import copy

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.fitting.refinement import RefinementResult, refine_block
from panther_lite.nn import SKLinear


def dense_block(seed=0):
    """Linear-Tanh-Linear with decaying spectra (trained-like: a low rank has room)."""
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(24, 48, dtype=torch.float64), nn.Tanh(), nn.Linear(48, 24, dtype=torch.float64))
    with torch.no_grad():
        for layer in (block[0], block[2]):
            u, s, v = torch.linalg.svd(layer.weight, full_matrices=False)
            layer.weight.copy_(3 * u @ torch.diag(s * 0.7 ** torch.arange(len(s))) @ v)
    return block


def calls(count=8, rows=64, seed=1, shift=0.0):
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(24, 24, dtype=torch.float64, generator=generator)
    return [torch.randn(rows, 24, dtype=torch.float64, generator=generator) @ mix * 0.4 + shift for _ in range(count)]


def converted_block(dense, calibration):
    """``dense`` converted at 30% stored on a calibration set unlike the data it is refined on,
    unshrunk (``shrinkage=0``: these tests measure refinement, not the shrinkage default)."""
    block = copy.deepcopy(dense)
    panther_lite.convert(block, param_ratio=0.3, calibration_data=calibration, shrinkage=0, progress=False)
    assert all(isinstance(block[i], SKLinear) for i in (0, 2))
    return block


def factors(block):
    return [p for name, p in block.named_parameters() if not name.endswith("bias")]


def setup(count=8):
    dense = dense_block()
    inputs = calls(count)
    with torch.no_grad():
        targets = [dense(x) for x in inputs]
    block = converted_block(dense, calls(2, seed=7, shift=1.0))  # perturbed calibration
    return dense, block, inputs, targets


def held_error(block, inputs, targets):
    with torch.no_grad():
        squared = sum((block(x) - t).square().sum() for x, t in zip(inputs, targets))
        return float((squared / sum(t.square().sum() for t in targets)).sqrt())


def held_back(inputs, targets):
    """The calls refine_block holds back of 8 at holdout 0.25: two, spread evenly (3 and 7)."""
    return [inputs[3], inputs[7]], [targets[3], targets[7]]


def test_refinement_lowers_the_error_on_held_back_and_fresh_calls():
    dense, block, inputs, targets = setup()
    fresh = calls(4, seed=11)
    with torch.no_grad():
        fresh_targets = [dense(x) for x in fresh]
    fresh_before = held_error(block, fresh, fresh_targets)
    result = refine_block(factors(block), lambda i: block(inputs[i]), targets, max_steps=60, lr=1e-2, patience=5)
    assert isinstance(result, RefinementResult)
    assert result.error_after < 0.85 * result.error_before
    assert result.error_after == pytest.approx(held_error(block, *held_back(inputs, targets)), rel=1e-9)
    assert held_error(block, fresh, fresh_targets) < 0.85 * fresh_before
    assert 1 <= result.steps <= 60


def test_no_improvement_leaves_every_parameter_bit_for_bit():
    _, block, inputs, targets = setup()
    before = {name: p.detach().clone() for name, p in block.named_parameters()}
    # a learning rate this large only makes things worse: the original parameters are kept
    result = refine_block(factors(block), lambda i: block(inputs[i]), targets, max_steps=5, lr=50.0, patience=2)
    assert result.error_after == result.error_before
    assert result.stopped_early
    for name, p in block.named_parameters():
        assert torch.equal(p, before[name]), name


def test_best_parameters_are_restored_not_the_last():
    _, block, inputs, targets = setup()
    result = refine_block(factors(block), lambda i: block(inputs[i]), targets, max_steps=40, lr=5e-2, patience=40)
    # whatever the last step did, the block holds the parameters of the best held-back error
    assert held_error(block, *held_back(inputs, targets)) == pytest.approx(result.error_after, rel=1e-12)
    assert result.error_after <= result.error_before


def test_a_single_call_holds_back_rows_of_it():
    _, block, inputs, targets = setup()
    result = refine_block(factors(block), lambda i: block(inputs[0]), targets[:1], max_steps=30, lr=1e-2, holdout=0.25)
    with torch.no_grad():
        held = (block(inputs[0])[48:] - targets[0][48:]).norm() / targets[0][48:].norm()
    assert float(held) == pytest.approx(result.error_after, rel=1e-9)
    assert result.error_after < result.error_before


def test_flags_and_gradients_are_restored():
    _, block, inputs, targets = setup()
    params = factors(block)
    for p in params:
        p.requires_grad_(False)
    refine_block(params, lambda i: block(inputs[i]), targets, max_steps=2)
    assert all(not p.requires_grad and p.grad is None for p in params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(parameters=[]), "parameters is empty"),
        (dict(targets=[]), "targets is empty"),
        (dict(lr=0.0), "lr must be"),
        (dict(holdout=1.0), "holdout must be"),
        (dict(max_steps=0), "max_steps"),
        (dict(patience=1.5), "patience"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    _, block, inputs, targets = setup(2)
    arguments = dict(parameters=factors(block), predict=lambda i: block(inputs[i]), targets=targets)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        refine_block(arguments.pop("parameters"), arguments.pop("predict"), arguments.pop("targets"), **arguments)


def test_a_prediction_of_the_wrong_shape_changes_nothing():
    _, block, inputs, targets = setup(3)
    before = [p.detach().clone() for p in factors(block)]
    with pytest.raises(ValueError, match=r"predict\(\d\) returned \(64, 23\)"):
        refine_block(factors(block), lambda i: block(inputs[i])[:, :23], targets)
    assert all(torch.equal(a, b) for a, b in zip(before, factors(block)))
    with pytest.raises(TypeError, match="predict must be a callable"):
        refine_block(factors(block), None, targets)
    with pytest.raises(ValueError, match="fewer than 2 output rows"):
        refine_block(factors(block), lambda i: block(inputs[0][:1]), [targets[0][:1]])
