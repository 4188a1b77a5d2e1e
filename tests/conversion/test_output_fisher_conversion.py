"""``output_fisher=True``: each fit weighs its output channels by the next-token Fisher, so the
predictions move less than with every channel alike (whole model, by blocks, sequential or
not); the fits are those of ``initialize_from_weight(..., output_gram=F)``; a layer the
logits do not reach is noted and fitted as before; bad uses are refused before anything changes."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import panther_lite
from panther_lite.conversion.calibration.batches import CalibrationData
from panther_lite.conversion.planning.output_fisher import fisher_targets, output_fishers
from panther_lite.conversion.selection import select_layers
from panther_lite.nn import SKLinear

pytestmark = pytest.mark.usefixtures("one_thread")


class _Classifier(nn.Module):
    """``{"logits": head(relu(layer(x)))}`` whose head reads a few of ``layer``'s channels
    strongly: the channels the Fisher weighs are not those with the most energy."""

    def __init__(self, seed: int = 0, extra: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.layer = nn.Linear(24, 24)
        self.head = nn.Linear(24, 6)
        self.side = nn.Linear(24, 20) if extra else None  # computed, never reaching the logits
        with torch.no_grad():
            self.layer.weight.copy_(torch.randn(24, 24, generator=gen) * torch.logspace(0, -1, 24))
            self.head.weight.copy_(torch.randn(6, 24, generator=gen) * torch.logspace(-2, 0.5, 24))

    def forward(self, x):
        hidden = torch.relu(self.layer(x))
        if self.side is not None:
            self.seen = self.side(x)
        return {"logits": self.head(hidden)}


def _batches(count: int = 4, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 24, generator=gen) for _ in range(count)]


def _kl(original, converted, batches) -> float:
    with torch.no_grad():
        pairs = [(original(x)["logits"].log_softmax(-1), converted(x)["logits"].log_softmax(-1)) for x in batches]
    return sum(float((p.exp() * (p - q)).sum(-1).mean()) for p, q in pairs) / len(pairs)


@pytest.mark.parametrize("sequential", [False, True])
def test_the_weighted_fit_moves_the_predictions_less(sequential):
    original, batches = _Classifier(), _batches()
    found = {}
    for weighted in (False, True):
        model = copy.deepcopy(original)
        report = panther_lite.convert(model, target_modules=["layer"], num_terms=1, low_rank=2, calibration_data=batches,
                                      sequential=sequential, output_fisher=weighted, shrinkage=0, progress=False)
        assert list(report["status"]) == ["converted"]
        found[weighted] = _kl(original, model, _batches(seed=2))  # held-out inputs
    assert found[True] < 0.5 * found[False]


class _TwoPaths(nn.Module):
    """Two copies of one layer, ``a`` and ``b``, whose heads read opposite ends of its output
    channels (``a``: the weak ones, ``b``: the strong ones): alike to the whitened spectra and
    to noise of a relative size, not to the predictions."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a, self.b, self.head_a, self.head_b = nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 6), nn.Linear(24, 6)
        weight, reads = torch.randn(24, 24, generator=gen) * torch.logspace(0, -1, 24)[:, None], torch.randn(6, 24, generator=gen)
        with torch.no_grad():
            self.a.weight.copy_(weight), self.b.weight.copy_(weight), self.b.bias.copy_(self.a.bias)
            self.head_a.weight.copy_(reads * torch.logspace(-2, 0.5, 24))
            self.head_b.weight.copy_(reads * torch.logspace(0.5, -2, 24))

    def forward(self, x):
        return {"logits": self.head_a(torch.relu(self.a(x))) + self.head_b(torch.relu(self.b(x)))}


@pytest.mark.parametrize("sequential", [False, True])
def test_the_global_plan_spends_the_budget_where_the_predictions_feel_it(sequential):
    original, batches, held_out = _TwoPaths(), _batches(), _batches(seed=2)
    options = dict(num_terms=1, calibration_data=batches, output_fisher=True, shrinkage=0, progress=False)
    planned = {}
    for weighted in (False, True):
        model = copy.deepcopy(original)
        report = panther_lite.convert(model, target_modules=["a", "b"], param_ratio=0.5, allocation="global",
                                      sequential=sequential, **dict(options, output_fisher=weighted))
        planned[weighted] = (tuple(int(rank) for rank in report["low_rank"]), _kl(original, model, held_out))
    splits = {}
    for ranks in [(1, 4), (2, 3), (3, 2), (4, 1)]:  # every split of the budget (5 ranks between them)
        model = copy.deepcopy(original)
        for name, rank in zip("ab", ranks):
            panther_lite.convert(model, target_modules=[name], low_rank=rank, **options)
        splits[ranks] = _kl(original, model, held_out)
    assert planned[True][0] != planned[False][0] and planned[True][0] == min(splits, key=splits.get)
    assert planned[True][1] < 1.25 * min(splits.values())  # the split's layers' Fishers measured one at a time


def test_the_fit_is_initialize_from_weight_with_the_measured_fisher():
    original, batches = _Classifier(), _batches()
    model = copy.deepcopy(original)
    panther_lite.convert(model, target_modules=["layer"], num_terms=1, low_rank=2, calibration_data=batches, output_fisher=True,
                         shrinkage=0, progress=False, seed=0)
    fisher = output_fishers(original, {"layer": original.layer}, CalibrationData(batches).runs())["layer"]
    gram = sum(x.double().t() @ x.double() for x in batches)
    expected = SKLinear(24, 24, num_terms=1, low_rank=2, seed=0)
    expected.initialize_from_weight(original.layer.weight.detach(), "svd", gram, output_gram=fisher.float())
    torch.testing.assert_close(model.layer.effective_weight(), expected.effective_weight(), rtol=1e-5, atol=1e-6)


def test_the_fishers_are_freed_after_the_fits():
    model = _Classifier()
    records = []
    real = panther_lite.conversion.fitting.layer.fit_layer

    def spy(record, *args, **kwargs):
        records.append(record)
        assert record.output_gram is not None and record.output_gram.shape == (24, 24)
        return real(record, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(panther_lite.conversion.fitting.planned, "fit_layer", spy)
        panther_lite.convert(model, target_modules=["layer"], num_terms=1, low_rank=2, calibration_data=_batches(),
                             output_fisher=True, progress=False)
    assert records and all(record.output_gram is None for record in records)


def test_a_layer_the_logits_do_not_reach_is_noted_and_fitted_as_before():
    original, batches = _Classifier(extra=True), _batches()
    plain, weighted = copy.deepcopy(original), copy.deepcopy(original)
    options = dict(target_modules=["layer", "side"], num_terms=1, low_rank=2, calibration_data=batches, shrinkage=0, progress=False)
    panther_lite.convert(plain, **options)
    report = panther_lite.convert(weighted, output_fisher=True, **options)
    side = report.set_index("name").loc["side"]
    assert "no next-token Fisher reached" in side["reason"]
    torch.testing.assert_close(weighted.side.effective_weight(), plain.side.effective_weight())
    assert not torch.allclose(weighted.layer.effective_weight(), plain.layer.effective_weight())


def test_only_feature_last_one_matrix_layers_take_a_fisher():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 4))
    records = select_layers(model, None, None, None)
    assert [record.name for record in fisher_targets(records)] == ["1"]


def _unchanged(model, before) -> bool:
    return all(torch.equal(before[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize("model, data, match", [
    (lambda: _Classifier(), None, "output_fisher=True .* pass calibration_data"),
    (lambda: nn.Sequential(nn.Linear(24, 8), nn.ReLU(), nn.Linear(8, 2)), _batches(), "no next-token logits"),
])
def test_bad_uses_are_refused_and_the_model_is_left_as_it_was(model, data, match):
    model = model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        panther_lite.convert(model, num_terms=1, low_rank=2, calibration_data=data, output_fisher=True, progress=False)
    assert _unchanged(model, before) and not any(m._forward_hooks for m in model.modules())


def test_across_processes_it_is_refused_naming_the_option():
    from panther_lite.conversion.process_groups.run import check_compress_across

    with pytest.raises(NotImplementedError, match="compress_checkpoint across 2 processes: output_fisher=True"):
        check_compress_across(SimpleNamespace(world=2), False, False, True)
    check_compress_across(SimpleNamespace(world=2), False, False, False)
