"""Fits split across processes: the predicted costs, the deterministic balanced owners, and one
process fitting every layer in order (the multi-process runs: tests/conversion/process_groups/test_run.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from panther_lite.conversion.fitting.across import fit_cost, fit_owners, fit_split


def _record(name: str, fan_in: int, fan_out: int, copies: int = 1):
    record = SimpleNamespace(name=name, copies=copies, fan_in=fan_in, fan_out=fan_out)
    record.parts = [record]
    return record


def _tinyllama_block():
    shapes = dict(q=(2048, 2048), k=(2048, 256), v=(2048, 256), o=(2048, 2048), gate=(2048, 5632), up=(2048, 5632),
                  down=(5632, 2048))
    return [_record(name, *shape) for name, shape in shapes.items()]


def test_the_cost_orders_a_tinyllama_block_as_measured():
    costs = {record.name: fit_cost(record) for record in _tinyllama_block()}
    assert costs["down"] > costs["up"] == costs["gate"] > costs["q"] == costs["o"] > costs["k"] == costs["v"]
    assert fit_cost(_record("experts", 32, 64, copies=4)) == 4 * fit_cost(_record("one", 32, 64))


def test_owners_balance_the_costs_the_same_on_every_call():
    records = _tinyllama_block()
    owners = fit_owners(records, 2)
    assert owners == fit_owners(records, 2)
    loads = [sum(fit_cost(r) for r, owner in zip(records, owners) if owner == rank) for rank in range(2)]
    assert max(loads) < 0.52 * sum(loads)
    assert owners[6] != owners[4]  # down apart from gate
    assert fit_owners(records, 1) == [0] * len(records)
    assert sorted(fit_owners(records[:3], 4)) == [0, 1, 2]  # fewer layers than ranks: one each


def test_one_process_fits_every_layer_in_order_and_passes_each():
    records, passed = _tinyllama_block(), []
    fits = fit_split(records, lambda index, record: (index, record.name), passed.append)
    assert list(fits.items()) == [(r.name, (i, r.name)) for i, r in enumerate(records)]
    assert passed == records


def test_one_process_raises_the_fit_error_itself():
    def failing(index, record):
        raise TypeError(f"bad {record.name}")

    with pytest.raises(TypeError, match="bad q"):
        fit_split(_tinyllama_block(), failing)
