"""Conversion across processes (``torchrun``): calibration batches sharded by rank, additive
statistics summed in rank order on every rank, fits made on every rank from the same sums."""
from .group import DistributedError, ProcessGroupRun, active_run
from .run import distributed_conversion

__all__ = ["DistributedError", "ProcessGroupRun", "active_run", "distributed_conversion"]
