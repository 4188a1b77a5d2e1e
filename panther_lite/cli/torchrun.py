"""The command under ``torchrun``: the process group started from torchrun's environment
(``WORLD_SIZE`` > 1) with the ``--collective-timeout``, gloo on CPUs or NCCL with one GPU per rank
(``--calibration-device cuda``), and ended when the command ends; only rank 0 reports progress, its
summary and its evaluation."""
from __future__ import annotations

import argparse
import datetime
import functools
import os
from typing import Callable

__all__ = ["add_distributed_arguments", "across_processes", "first_process", "several_processes"]

DEFAULT_TIMEOUT = 1800.0


def add_distributed_arguments(command: argparse.ArgumentParser) -> None:
    group = command.add_argument_group("across processes (torchrun --nproc-per-node N -m panther_lite compress ...)")
    group.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                       help="how long a process waits for the others at each exchange of statistics before the run "
                            f"stops with an error naming the exchange (default {DEFAULT_TIMEOUT:g})")


def several_processes() -> bool:
    """Whether the command runs as one of several processes (torchrun's ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def first_process() -> bool:
    """Whether this process reports (the summary line, ``--eval``): rank 0, or the only process."""
    return not several_processes() or int(os.environ.get("RANK", "0")) == 0


def _backend(args: argparse.Namespace) -> str:
    import torch

    device = str(getattr(args, "calibration_device", None) or "")
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return "nccl"
    return "gloo"


def across_processes(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` inside the process group torchrun's environment describes (none: ``run`` as it is)."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        if not several_processes():
            return run(args)
        import torch.distributed as dist

        if dist.is_initialized():
            return run(args)
        timeout = datetime.timedelta(seconds=args.collective_timeout)
        dist.init_process_group(_backend(args), timeout=timeout)
        try:
            if dist.get_rank() != 0:
                args.quiet = True
            return run(args)
        finally:
            dist.destroy_process_group()

    return wrapper
