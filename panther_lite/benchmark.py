"""Measurement library: timing, memory, accuracy, sweeps and plots.

Timing uses warm-up and the median of repeats: ``time.perf_counter`` around each call
on the CPU; CUDA events recorded on the current stream, with a device synchronisation
before and after, on the GPU.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Union

import torch

__all__ = ["time_callable"]


def _check_counts(warmup: int, repeats: int) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")


def time_callable(
    fn: Callable[[], object],
    *,
    device: Union[str, torch.device] = "cpu",
    warmup: int = 3,
    repeats: int = 10,
) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    Args:
        fn: a callable taking no arguments (its result is discarded).
        device: where ``fn`` runs. ``"cpu"`` times each call with ``time.perf_counter``;
            a CUDA device records CUDA events around each call on the current stream
            and synchronises before timing and before reading the events.
        warmup: untimed calls first (allocator, kernel selection, caches).
        repeats: timed calls; the median is returned.
    """
    _check_counts(warmup, repeats)
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for start, end in zip(starts, ends):
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) for start, end in zip(starts, ends)]
    else:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(times))
