"""Timing: warm-up, then calls timed one by one — ``perf_counter`` on the CPU, CUDA events
on a GPU — interleaved across the callables being compared, and summarised by the median
and the interquartile range."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from .environment import DeviceLike, as_device, check_int

L2_FLUSH_BYTES = 256 * 1024 * 1024  # over any current GPU's L2 (H100: 50 MB, B200: 126 MB)
_clock = time.perf_counter  # the CPU clock (a module attribute, so tests can replace it)


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of ``count`` samples (``iqr = q3 − q1``)."""

    median: float
    q1: float
    q3: float
    count: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        """The spread of one or more ``values`` (inclusive quartiles, as ``numpy.percentile``)."""
        values = [float(v) for v in values]
        if not values:
            raise ValueError("a spread needs at least one value")
        if len(values) == 1:
            return cls(values[0], values[0], values[0], 1)
        q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median, q1, q3, len(values))


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    device: DeviceLike = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    flush_cache: bool = True,
) -> Dict[str, List[float]]:
    """Time several callables in alternation; returns every sample (ms) per name.

    Each of ``repeats`` rounds calls every callable once, starting one further along each
    round (round ``r`` starts with callable ``r mod n``), so a burst of other work on the
    machine slows every callable of the rounds it overlaps alike: sample ``i`` of two
    names was taken in the same round, and their ratio (:func:`paired_ratio`) stays fair
    under load. Warm-up calls are interleaved the same way and not timed.

    Args:
        fns: name → callable taking no arguments (results are discarded).
        device: where they run. ``"cpu"`` times each call with ``time.perf_counter``; a
            CUDA device records CUDA events around each call on the current stream and
            synchronises before timing and before reading the events.
        warmup: untimed rounds first (allocator, kernel selection, caches).
        repeats: timed rounds.
        flush_cache: on CUDA, overwrite a buffer larger than the L2 cache before each
            timed call (outside the events), so inputs that would fit in L2 are read
            from device memory, as the roofline assumes.
    """
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)
    device = as_device(device)
    names = list(fns)
    if not names:
        raise ValueError("fns must hold at least one callable")
    order = [[names[(r + i) % len(names)] for i in range(len(names))] for r in range(warmup + repeats)]
    for round_names in order[:warmup]:
        for name in round_names:
            fns[name]()
    timed = order[warmup:]
    if device.type == "cuda":
        return _cuda_rounds(fns, timed, device, flush_cache)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for round_names in timed:
        for name in round_names:
            start = _clock()
            fns[name]()
            samples[name].append((_clock() - start) * 1e3)
    return samples


def _cuda_rounds(fns, rounds: List[List[str]], device: torch.device, flush_cache: bool) -> Dict[str, List[float]]:
    """The timed rounds of :func:`time_interleaved` with CUDA events."""
    with torch.cuda.device(device):
        scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_cache else None
        torch.cuda.synchronize()
        events: Dict[str, list] = {name: [] for name in fns}
        for round_names in rounds:
            for name in round_names:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if scratch is not None:
                    scratch.zero_()
                start.record()
                fns[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
    return {name: [start.elapsed_time(end) for start, end in pairs] for name, pairs in events.items()}


def time_callable(
    fn: Callable[[], object],
    *,
    device: DeviceLike = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    flush_cache: bool = True,
) -> float:
    """Median wall time of ``fn()`` in milliseconds (:func:`time_interleaved` of ``fn`` alone:
    ``warmup`` untimed calls, then ``repeats`` timed ones)."""
    samples = time_interleaved({"fn": fn}, device=device, warmup=warmup, repeats=repeats, flush_cache=flush_cache)
    return float(statistics.median(samples["fn"]))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """The spread of ``numerator[i] / denominator[i]``: per-round ratios of two timings
    taken by one :func:`time_interleaved` call (e.g. dense time / sketched time)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"numerator and denominator must be non-empty and of one length, got {len(numerator)} and {len(denominator)}"
        )
    return Spread.of([a / b for a, b in zip(numerator, denominator)])


def forward_step(fn: Callable[[Tensor], object], x: Tensor, *, inference_mode: bool = False) -> Callable[[], object]:
    """A callable running ``fn(x)`` without recording autograd (``fn``: a module or any
    function of ``x``): under ``torch.no_grad()``, or ``torch.inference_mode()`` when
    ``inference_mode`` (no version counters or views tracked: the cheapest eager call)."""
    context = torch.inference_mode if inference_mode else torch.no_grad

    def step() -> object:
        with context():
            return fn(x)

    return step


def forward_backward_step(module: nn.Module, x: Tensor) -> Callable[[], object]:
    """A callable running one forward and backward of ``module`` on ``x``: the gradients of
    the input and of every trainable parameter for a fixed random output gradient
    (``torch.autograd.grad``, so nothing accumulates between calls)."""
    x = x.detach().requires_grad_(True)
    inputs = [x, *(p for p in module.parameters() if p.requires_grad)]
    with torch.no_grad():
        grad_out = torch.randn_like(module(x))

    def step() -> object:
        with torch.enable_grad():
            return torch.autograd.grad(module(x), inputs, grad_out)

    return step
