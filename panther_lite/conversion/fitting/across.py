"""Fits split across the processes of a conversion: each layer fitted by one rank, chosen by its
predicted cost, and its fit (module, report figures, notes) sent to every rank, so every rank
swaps in the same modules and writes the same report; in one process every layer is fitted here.
"""
from __future__ import annotations

import io
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..process_groups.group import ProcessGroupRun, active_run
from ..records import LayerRecord, records_entry, restore_records
from .layer import FitResult

Fit = Callable[[int, LayerRecord], FitResult]


def fit_cost(record: LayerRecord) -> int:
    """The predicted cost of ``record``'s fit: ``copies·fan_out·fan_in²`` summed over its weight
    stacks (whitening by a ``fan_in²`` Gram for each output row). On a TinyLlama block it orders
    the measured fits and sizes them within about 25 % (``benchmarks/bench_fit_split.py``)."""
    return sum(part.copies * part.fan_out * part.fan_in ** 2 for part in record.parts)


def fit_owners(records: Sequence[LayerRecord], world: int) -> List[int]:
    """The rank fitting each of ``records``: the costliest first (ties: in order) to the rank with
    the least predicted cost so far (ties: the lowest rank). The same on every rank."""
    costs = [fit_cost(record) for record in records]
    loads, owners = [0] * world, [0] * len(records)
    for index in sorted(range(len(records)), key=lambda i: -costs[i]):
        owners[index] = min(range(world), key=lambda rank: loads[rank])
        loads[owners[index]] += costs[index]
    return owners


def fit_split(
    records: List[LayerRecord], fit: Fit, after: Optional[Callable[[LayerRecord], None]] = None,
    bar: Optional[Callable[[List[LayerRecord]], Iterable[LayerRecord]]] = None,
) -> Dict[str, FitResult]:
    """``{name: fit(i, record)}`` for each of ``records`` in order: in one process all fitted
    here; across processes each by its owner (:func:`fit_owners`), then gathered, so every rank
    holds every fit (and the notes the fits added to the records). ``after(record)`` runs on every
    rank once a record is passed (fitted here or by another rank); ``bar`` wraps the loop (a
    progress bar). A fit failing on one rank raises on every rank, naming the layer and rank."""
    run = active_run()
    owners = [0] * len(records) if run is None else fit_owners(records, run.world)
    here = 0 if run is None else run.rank
    fits: Dict[str, FitResult] = {}
    failed: Optional[Tuple[str, Exception]] = None
    for index, record in enumerate(records if bar is None else bar(records)):
        if owners[index] == here and failed is None:
            try:
                fits[record.name] = fit(index, record)
            except Exception as error:
                if run is None:
                    raise
                failed = record.name, error
        if after is not None:
            after(record)
    return fits if run is None else _exchanged(run, records, fits, failed)


def _on_this_rank(storage, location: str):
    """``torch.load``'s map: a tensor on the CPU stays there, one on a GPU goes to this rank's."""
    return storage if location == "cpu" else storage.cuda()


def _exchanged(
    run: ProcessGroupRun, records: List[LayerRecord], fits: Dict[str, FitResult], failed: Optional[Tuple[str, Exception]]
) -> Dict[str, FitResult]:
    """Every rank's ``fits`` (and the notes they added to ``records``), in ``records``' order."""
    buffer = io.BytesIO()
    problem = None if failed is None else (failed[0], f"{type(failed[1]).__name__}: {failed[1]}")
    mine = [record for record in records if record.name in fits]
    torch.save(dict(fits=fits, records=records_entry(mine), failed=problem), buffer)
    payloads = run.gather_objects(buffer.getvalue(), "fitted layers")
    if failed is not None:
        raise failed[1]
    found = dict(fits)
    for rank, payload in enumerate(payloads):
        if rank == run.rank:
            continue
        theirs = torch.load(io.BytesIO(payload), map_location=_on_this_rank, weights_only=False)
        if theirs["failed"] is not None:
            name, message = theirs["failed"]
            raise RuntimeError(f"panther_lite: fitting layer {name!r} failed on process {rank} ({message}); see its log")
        restore_records(records, theirs["records"])
        found.update(theirs["fits"])
    return {record.name: found[record.name] for record in records}
