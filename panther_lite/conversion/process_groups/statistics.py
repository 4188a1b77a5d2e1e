"""Calibration statistics made global: every rank's sums (Grams, row moments, held-back halves,
sequential fits' paired Grams, mixture-of-experts per-expert statistics) replaced by their sum over the ranks in rank order, so each rank
fits from the same statistics; per-rank flags agreed; rank 0's gains used by all. Each function
does nothing in one process."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch import Tensor

from .group import active_run

__all__ = [
    "reduce_recorders", "reduce_group_statistics", "agree_any", "gains_from_first", "measured_on_first",
    "measured_by_first", "first_problem",
]


def _moment_parts(moments, device) -> tuple:
    off = moments.cluster_off_diagonal
    off = torch.zeros((), dtype=torch.float64, device=device) if off is None else off
    return [off], [moments.rows, moments.cluster_rows_squared]


def _set_moments(moments, off: Tensor, ints: List[int]) -> None:
    moments.rows, moments.cluster_rows_squared = ints
    moments.cluster_off_diagonal = off if moments.rows else None


def _parts(owner, grams: List[str]):
    """The tensors and integers of ``owner`` (a recorder or a sequential group's statistics)."""
    tensors = [getattr(owner, name) for name in grams]
    device = tensors[0].device
    off, ints = _moment_parts(owner.moments, device)
    tensors, ints = tensors + off, ints + [int(bool(owner.unaligned))]
    if owner.held is not None:
        held_off, held_ints = _moment_parts(owner.held.moments, device)
        tensors += [owner.held.gram] + held_off
        ints += held_ints + [owner.held.clusters]
    return tensors, ints


def _assign(owner, grams: List[str], tensors: List[Tensor], ints: List[int]) -> None:
    for name, tensor in zip(grams, tensors):
        getattr(owner, name).copy_(tensor)
    _set_moments(owner.moments, tensors[len(grams)], ints[:2])
    owner.unaligned = bool(ints[2])
    if owner.held is not None:
        owner.held.gram.copy_(tensors[len(grams) + 1])
        _set_moments(owner.held.moments, tensors[len(grams) + 2], ints[3:5])
        owner.held.clusters = ints[5]


def _reduce(owners: List, grams: List[str], what: str) -> None:
    run = active_run()
    if run is None or not owners:
        return
    tensors, ints, shape = [], [], []
    for owner in owners:
        t, i = _parts(owner, grams)
        tensors += t
        ints += i
        shape.append((len(t), len(i)))
    tensors, ints = run.sum_in_rank_order(tensors, what), run.sum_ints(ints, what + " (row counts)")
    at_t = at_i = 0
    for owner, (n_t, n_i) in zip(owners, shape):
        _assign(owner, grams, tensors[at_t:at_t + n_t], ints[at_i:at_i + n_i])
        at_t, at_i = at_t + n_t, at_i + n_i


def reduce_recorders(records: Iterable, recorders: Dict[str, object]) -> None:
    """Sum each distinct Gram recorder of ``recorders`` over the ranks, in ``records``' order
    (the same on every rank), mixture-of-experts recorders included; another kind's own recorder
    is a NotImplementedError naming the layer."""
    if active_run() is None:
        return
    owners, seen = [], set()
    for record in records:
        recorder = recorders.get(record.name)
        if recorder is None or id(recorder) in seen:
            continue
        if all(hasattr(recorder, name) for name in ("grams", "moments", "expert_rows")):
            seen.add(id(recorder))
            _reduce_experts(recorder)
            continue
        if not all(hasattr(recorder, name) for name in ("gram", "moments", "held", "unaligned")):
            raise NotImplementedError(
                f"convert across processes: layer {record.name!r} records {type(recorder).__name__} statistics "
                "that panther_lite does not know how to sum across processes; run it in one process"
            )
        seen.add(id(recorder))
        owners.append(recorder)
    _reduce(owners, ["gram"], "calibration Grams")


def _reduce_experts(recorder) -> None:
    """A mixture-of-experts recorder's per-expert Gram stacks, row moments and routed row counts
    summed over the ranks (each expert's rows, wherever they were routed)."""
    run = active_run()
    projections = list(recorder.grams)
    device = recorder.grams[projections[0]].device
    tensors, ints = [recorder.grams[p] for p in projections], list(recorder.expert_rows)
    ints += [recorder.rows, int(bool(recorder.unaligned))]
    for projection in projections:
        for moments in recorder.moments[projection]:
            off, counts = _moment_parts(moments, device)
            tensors, ints = tensors + off, ints + counts
    tensors = run.sum_in_rank_order(tensors, f"expert Grams of {recorder.record.name}")
    ints = run.sum_ints(ints, f"expert row counts of {recorder.record.name}")
    experts = len(recorder.expert_rows)
    for projection, summed in zip(projections, tensors):
        recorder.grams[projection].copy_(summed)
    recorder.expert_rows, recorder.rows, recorder.unaligned = ints[:experts], ints[experts], bool(ints[experts + 1])
    at_t, at_i = len(projections), experts + 2
    for projection in projections:
        for moments in recorder.moments[projection]:
            _set_moments(moments, tensors[at_t], ints[at_i:at_i + 2])
            at_t, at_i = at_t + 1, at_i + 2


def reduce_group_statistics(stats) -> None:
    """A sequential group's paired Grams ``G̃, C, G``, moments and held-back half summed over the ranks."""
    _reduce([stats], ["current", "cross", "original"], "sequential calibration Grams")


def agree_any(flags: List[bool], what: str) -> List[bool]:
    """Each flag True when it is on some rank (one process: unchanged)."""
    run = active_run()
    return list(flags) if run is None else run.any(flags, what)


def gains_from_first(gains, what: str = "output gains"):
    """Rank 0's gains (measured on the first calibration batch, which rank 0 holds), on every rank."""
    run = active_run()
    return gains if run is None else run.from_first(gains, what)


def measured_on_first(function: Callable) -> Callable:
    """``function`` (gains measured on one calibration batch) returning rank 0's result on every rank."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return gains_from_first(function(*args, **kwargs), function.__name__)

    return wrapper


def measured_by_first(function: Callable) -> Callable:
    """``function`` (gains measured on the first calibration batch) run by rank 0 alone, its
    result sent to every rank: for a measurement the other ranks cannot make (it needs the first
    batch) or should not pay for (the streamed pipeline's pass over every block)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        run = active_run()
        if run is None:
            return function(*args, **kwargs)
        return run.from_first(function(*args, **kwargs) if run.rank == 0 else None, function.__name__)

    return wrapper


def first_problem(problem: Optional[str]) -> Optional[str]:
    """The first rank's problem (a reason a pipeline cannot run, found on its own batches), so every
    rank chooses the same pipeline; None when no rank found one."""
    run = active_run()
    if run is None:
        return problem
    found = [(rank, p) for rank, p in enumerate(run.gather_objects(problem, "pipeline checks")) if p is not None]
    if not found:
        return None
    rank, first = found[0]
    return first if rank == run.rank else f"{first} (on the batches of process {rank})"
