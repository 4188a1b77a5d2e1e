"""Distillation across processes: which of the batches (the data's, then the random-token ones)
this rank runs, by the calibration rule (batch ``i`` on rank ``i % world``), once every rank is
seen to hold the same batches; a teacher-output cache's share checked against the group."""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence, Tuple

from ..calibration.batches import add_to_digest
from .group import ProcessGroupRun

__all__ = ["Owned", "batch_owner", "check_cache_share", "share_of"]

Owned = Callable[[int], bool]
"""``owned(i)``: whether batch ``i`` runs on this rank."""


def share_of(run: Optional[ProcessGroupRun]) -> Tuple[int, int]:
    """``(rank, world)`` of ``run``; ``(0, 1)`` in one process."""
    return (0, 1) if run is None else (run.rank, run.world)


def batch_owner(run: Optional[ProcessGroupRun], batches: Sequence, caller: str) -> Owned:
    """Which batches are this rank's (all in one process). Across processes a ValueError, the same
    on every rank, when the ranks hold different batches (count, dtypes, shapes or values: every
    rank passes all of them) or fewer batches than processes (a rank would have none)."""
    if run is None:
        return lambda index: True
    digest = hashlib.sha256()
    for batch in batches:
        add_to_digest(digest, batch)
    seen = run.gather_objects((len(batches), digest.hexdigest()), f"the {caller} batches")
    differ = next((rank for rank, other in enumerate(seen) if other != seen[0]), None)
    if differ is not None:
        raise ValueError(
            f"{caller} across {run.world} processes: the batches of process {differ} differ from those of process 0 "
            f"({seen[differ][0]} and {seen[0][0]} batches, or their dtypes, shapes or values); pass every process all "
            f"the batches (batch i runs on process i % {run.world})"
        )
    if len(batches) < run.world:
        raise ValueError(
            f"{caller} across {run.world} processes: data holds {len(batches)} batch(es) (with the random-token "
            f"ones), fewer than the processes, so a process would have none (batch i runs on process i % {run.world}); "
            "give at least one batch per process, or run on fewer processes"
        )
    return lambda index: index % run.world == run.rank


def check_cache_share(cached: Tuple[int, int], run: Optional[ProcessGroupRun]) -> None:
    """ValueError unless a teacher-output cache holding process ``cached = (rank, world)``'s share
    (``(0, 1)``: every batch) serves this rank of ``run``."""
    rank, world = cached
    if world == 1 or (rank, world) == share_of(run):
        return
    here = "one process" if run is None else f"process {run.rank} of {run.world}"
    raise ValueError(
        f"distill: the teacher's outputs hold the share of process {rank} of {world} (batch i on process i % {world}), "
        f"but distill runs as {here}; distill on the processes that cached them (or cache them in one process)"
    )
