"""Planning a record of several weight stacks (a mixture-of-experts module): the allocation's
stacked spectra (one per expert, one shared rank), the settling that keeps such a module
wholly dense or wholly sketched, and the budgets at the ends of the range."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from panther_lite.conversion.planning.allocation import Allocation, LayerSpectrum, allocate_budget, largest_sketch
from panther_lite.conversion.planning.global_plan import _settle
from panther_lite.nn import dense_size, sketch_size


def _stacked(copies=3, fan_in=12, fan_out=20, seed=0):
    generator = torch.Generator().manual_seed(seed)
    energy = torch.rand(copies, min(fan_in, fan_out), generator=generator, dtype=torch.float64) ** 4
    return LayerSpectrum(fan_in, fan_out, False, energy, copies=copies)


@pytest.mark.parametrize("budget_ratio", [0.3, 0.45, 0.7])
def test_a_stack_is_sized_by_its_summed_tails_and_costs_copies_times_one_matrix(budget_ratio):
    layer = _stacked()
    dense = layer.copies * dense_size(layer.fan_in, layer.fan_out, False)
    (chosen,) = allocate_budget([layer], budget_ratio * dense, num_terms=1)
    assert chosen.low_rank is not None
    rank = 2 * chosen.low_rank
    energy = layer.energy.sort(dim=-1, descending=True).values
    assert chosen.error == pytest.approx(float(energy[:, rank:].sum() / energy.sum()), rel=1e-12)
    assert chosen.stored == layer.copies * sketch_size(layer.fan_in, layer.fan_out, 1, chosen.low_rank, False).stored
    assert chosen.stored <= budget_ratio * dense
    # the largest rank within the budget: one more step would not fit
    assert layer.copies * sketch_size(12, 20, 1, chosen.low_rank + 1, False).stored > budget_ratio * dense or rank + 2 >= 12


def test_the_largest_sketch_is_cheaper_than_dense_and_none_when_nothing_is():
    layer = _stacked()
    found = largest_sketch(layer, num_terms=1)
    dense = layer.copies * dense_size(12, 20, False)
    assert found.stored < dense <= layer.copies * sketch_size(12, 20, 1, found.low_rank + 1, False).stored
    narrow = LayerSpectrum(64, 1, False, torch.ones(3, 1, dtype=torch.float64), copies=3)
    assert largest_sketch(narrow, num_terms=1) is None


def _module_parts():
    """``[(other layer, itself), (module, up part), (module, down part)]``, each part three 12→20 matrices."""
    record = SimpleNamespace(name="experts")
    dense = 3 * dense_size(12, 20, False)
    parts = [(record, SimpleNamespace(name=f"experts.{p}", dense_params=dense)) for p in ("up", "down")]
    other = SimpleNamespace(name="other", dense_params=100)
    return [(other, other)] + parts


def _mixed_plan():
    """The other layer at 100 entries, the up part sketched at k=2, the down part dense."""
    return [Allocation(2, 100, 0.1), Allocation(2, 3 * sketch_size(12, 20, 1, 2, False).stored, 0.2), Allocation(None, 720, 0.0)]


def test_settling_keeps_a_module_dense_whole_when_the_budget_left_pays_for_it():
    parts, plan = _module_parts(), _mixed_plan()
    spectra = [_stacked(seed=s) for s in range(3)]
    extra = 720 - plan[1].stored
    settled = _settle(parts, spectra, plan, budget=sum(a.stored for a in plan) + extra, num_terms=1)
    assert settled[0] == plan[0] and settled[1] == Allocation(None, 720, 0.0) and settled[2] == plan[2]


def test_settling_sketches_the_dense_parts_when_the_budget_left_does_not_pay():
    parts, plan = _module_parts(), _mixed_plan()
    spectra = [_stacked(seed=s) for s in range(3)]
    budget = sum(a.stored for a in plan) + 720 - plan[1].stored - 1
    settled = _settle(parts, spectra, plan, budget=budget, num_terms=1)
    assert settled[:2] == plan[:2] and settled[2] == largest_sketch(spectra[2], 1)
    assert sum(a.stored for a in settled) <= budget
