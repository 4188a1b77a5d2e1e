"""Starting a conversion across processes: the process group resolved (``process_group=``, else
the initialised default group of ``torch.distributed``), the options that cannot run across
processes refused naming them, the calibration batches sharded by rank (batch ``i`` on rank
``i % world``) for the duration, and rank 0's value of a workflow's decision sent to every rank."""
from __future__ import annotations

import contextlib
from itertools import islice
from typing import Iterator, Optional

from torch import Tensor
from torch.utils._pytree import tree_flatten

from ..calibration.batches import CalibrationData
from .group import ProcessGroupRun, active_run, running_on

__all__ = ["distributed_conversion", "resolve_run", "ShardedBatches", "check_compress_across", "from_first_process"]


def resolve_run(process_group=None) -> Optional[ProcessGroupRun]:
    """The conversion's process group (``process_group``, else the one active for an enclosing
    workflow, else the default group), or None for one process (torch.distributed not
    initialised, or a world of one)."""
    import torch.distributed as dist

    if process_group is None and active_run() is not None:
        return active_run()

    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised (init_process_group)")
        return None
    run = ProcessGroupRun(process_group)
    return run if run.world > 1 else None


class ShardedBatches:
    """Rank ``rank``'s share of re-iterable batches: those whose index ``i`` has ``i % world == rank``."""

    def __init__(self, source, rank: int, world: int) -> None:
        self.source, self.rank, self.world = source, rank, world

    def __iter__(self) -> Iterator:
        return islice(iter(self.source), self.rank, None, self.world)


def _sequences(batch) -> Optional[int]:
    leaves = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor) and leaf.dim() >= 1]
    return int(leaves[0].shape[0]) if leaves else None


def _check_data(data: CalibrationData, run: ProcessGroupRun, held_back: bool) -> None:
    if callable(data.source):
        raise NotImplementedError(
            "convert across processes: calibration_data is a callable fn(model), which cannot be split by rank; "
            "pass a list of batches (or a DataLoader)"
        )
    if not data.reiterable:
        raise NotImplementedError(
            "convert across processes: calibration_data is a one-shot iterator; pass a list of batches or a DataLoader"
        )
    batches = list(data.source) if not hasattr(data.source, "__len__") else data.source
    if len(batches) < run.world:
        raise ValueError(
            f"convert across {run.world} processes: calibration_data holds {len(batches)} batches, fewer than the "
            "processes; give each process at least one batch"
        )
    if held_back:  # HeldBack alternates clusters across batches: equal halves on any world size need even batches
        odd = [i for i, batch in enumerate(batches) if i < len(batches) - 1 and (_sequences(batch) or 0) % 2]
        if odd:
            raise ValueError(
                f"convert across processes with shrinkage='auto': calibration batch {odd[0]} holds an odd number of "
                "sequences, so the held-back half of the rows would depend on the number of processes; use batches of "
                "an even size (all but the last), or a fixed shrinkage (a float, or 0)"
            )


@contextlib.contextmanager
def distributed_conversion(process_group, config, data: CalibrationData) -> Iterator[CalibrationData]:
    """The calibration data this rank runs (all of it in one process) while the process group is
    active; options not supported across processes raise, naming them."""
    run = resolve_run(process_group)
    if run is None:
        yield data
        return
    _check_one_process_options(config.output_fisher, run, "convert")
    if data.given:
        _check_data(data, run, config.held_back)
        data = CalibrationData(ShardedBatches(data.source, run.rank, run.world))
    with running_on(run):
        yield data


def _check_one_process_options(output_fisher: bool, run: ProcessGroupRun, caller: str) -> None:
    if output_fisher:
        raise NotImplementedError(
            f"{caller} across {run.world} processes: output_fisher=True is not supported (each process would measure "
            "the Fisher on its own batches alone); run it in one process"
        )


def check_compress_across(run: ProcessGroupRun, in_memory: bool, resume: bool, output_fisher: bool = False) -> None:
    """``compress_checkpoint``'s options that cannot run across processes, refused naming them."""
    _check_one_process_options(output_fisher, run, "compress_checkpoint")
    if resume and in_memory:
        raise NotImplementedError(
            f"compress_checkpoint across {run.world} processes: resume=True is not supported with in_memory=True; "
            "an in-memory run keeps no work to resume"
        )


def from_first_process(value, what: str):
    """Rank 0's ``value`` (picklable) on every process of the conversion's group (``value`` in one
    process): for a workflow's decisions, taken alike on every rank."""
    run = resolve_run(None)
    return value if run is None else run.from_first(value, what)
