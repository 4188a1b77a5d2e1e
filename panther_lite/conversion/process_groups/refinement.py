"""Block refinement across processes: where each rank's cached calls stand among all of them
(batch ``i`` on rank ``i % world``), per-call sums added in that global order (the one-process
bits), and the gradients of the rank's calls summed over the ranks in rank order, so every rank
takes the same Adam step. Each function is the one-process computation when no group is active."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from .group import active_run

__all__ = ["call_positions", "sum_in_call_order", "sum_gradients"]


def call_positions(calls: int, parameters: Sequence[Tensor]) -> Tuple[int, List[int]]:
    """The number of calls on every rank together and the place of each of this rank's ``calls``
    among them (rank ``r``'s ``j``-th call is call ``r + j·world``). Across processes a
    ValueError, the same on every rank, when the ranks do not refine the same parameters or do
    not hold the calls that sharding by rank gives them."""
    run = active_run()
    if run is None:
        return calls, list(range(calls))
    shapes = [(tuple(p.shape), str(p.dtype)) for p in parameters]
    seen = run.gather_objects((calls, shapes), "the refined block's calls and parameters")
    if any(other != shapes for _, other in seen):
        differ = next(rank for rank, (_, other) in enumerate(seen) if other != shapes)
        raise ValueError(
            f"refine_block across {run.world} processes: the parameters of process {differ} differ from those of "
            f"process {run.rank} (shapes or dtypes); every process must refine the same block"
        )
    total = sum(count for count, _ in seen)
    expected = [len(range(rank, total, run.world)) for rank in range(run.world)]
    if [count for count, _ in seen] != expected:
        raise ValueError(
            f"refine_block across {run.world} processes: the processes hold {[count for count, _ in seen]} cached "
            f"calls (targets), but the {total} calls sharded by rank (call i on process i % {run.world}) give "
            f"{expected}; pass each process the calls of its own calibration batches"
        )
    return total, [run.rank + j * run.world for j in range(calls)]


def sum_in_call_order(values: Sequence[Tuple[float, ...]], positions: Sequence[int], total: int, width: int,
                      what: str) -> Tuple[float, ...]:
    """Per-call float64 values (a tuple of ``width`` per local call, at ``positions``) summed over
    every rank's calls in call order, the same bits on every rank as in one process: the ranks'
    rows are exchanged exactly (each row is nonzero on one rank only), then added call by call."""
    run = active_run()
    if run is None:
        rows = list(values)
    else:
        table = torch.zeros(total, width, dtype=torch.float64)
        for position, row in zip(positions, values):
            table[position] = torch.tensor(row, dtype=torch.float64)
        rows = [tuple(row) for row in run.sum_in_rank_order([table], what)[0].tolist()]
    sums = [0.0] * width
    for row in rows:
        sums = [done + value for done, value in zip(sums, row)]
    return tuple(sums)


def sum_gradients(parameters: Sequence[Tensor], failed: bool) -> bool:
    """Each parameter's ``.grad`` (this rank's calls) replaced by its sum over the ranks in rank
    order (zeros for a rank without one; None where no rank has one). Returns whether some rank
    ``failed`` (a non-finite loss): then nothing is exchanged and no rank steps."""
    run = active_run()
    if run is None:
        return failed
    flags = run.any([failed] + [p.grad is not None for p in parameters], "the refinement losses' check")
    if flags[0]:
        return True
    held = [p for p, has in zip(parameters, flags[1:]) if has]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in held]
    for parameter, summed in zip(held, run.sum_in_rank_order(grads, "the refinement gradients")):
        parameter.grad = summed
    return False
