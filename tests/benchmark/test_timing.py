"""Timing: warm-up and repeats, the median, interleaved rounds whose ratios stay fair under
load, spreads, and the forward / forward+backward steps (CPU timings on a fake clock)."""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn as nn

from panther_lite.benchmark import (
    Spread,
    forward_backward_step,
    forward_step,
    paired_ratio,
    time_callable,
    time_interleaved,
)


def test_time_callable_runs_warmup_plus_repeats_and_returns_the_median(fake_clock):
    costs = iter([7.0, 1.0, 1.0, 50.0])  # one warm-up, then 1 ms, 1 ms and one 50 ms outlier
    calls = []

    def fn():
        calls.append(1)
        fake_clock.advance(next(costs))

    assert time_callable(fn, warmup=1, repeats=3) == pytest.approx(1.0)  # a mean would include the outlier
    assert len(calls) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(warmup=-1), "warmup"), (dict(repeats=0), "repeats"), (dict(repeats=2.5), "repeats"),
     (dict(device="meta"), "CPU or CUDA")],
)
def test_time_callable_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        time_callable(lambda: None, **kwargs)


def test_time_interleaved_alternates_and_rotates_the_order(fake_clock):
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = time_interleaved(fns, warmup=1, repeats=3)
    assert calls == list("abc" "bca" "cab" "abc")  # warm-up round, then three timed rounds
    assert {name: len(s) for name, s in samples.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="at least one"):
        time_interleaved({})


def test_interleaved_ratio_is_unchanged_by_a_burst_of_load(fake_clock):
    """A burst slows every callable of the rounds it covers alike, so the per-round ratio
    (dense 10 ms / sketched 1 ms) stays exact where separate timings would not."""
    calls = []

    def call(ms):
        calls.append(ms)
        fake_clock.load = 40.0 if 4 <= (len(calls) - 1) // 2 <= 10 else 1.0  # a burst over rounds 4–10
        fake_clock.advance(ms)

    samples = time_interleaved({"dense": lambda: call(10.0), "sketched": lambda: call(1.0)}, warmup=0, repeats=12)
    assert max(samples["dense"]) == pytest.approx(400.0)  # the burst was there
    ratio = paired_ratio(samples["dense"], samples["sketched"])
    assert (ratio.median, ratio.q1, ratio.q3, ratio.count) == pytest.approx((10.0, 10.0, 10.0, 12))


def test_spread_has_the_median_and_inclusive_quartiles():
    assert Spread.of([4.0, 1.0, 3.0, 2.0, 5.0]) == Spread(median=3.0, q1=2.0, q3=4.0, count=5)
    assert Spread.of([2.5]).iqr == 0.0
    assert Spread.of([1.0, 2.0, 3.0, 4.0]).iqr == pytest.approx(1.5)
    with pytest.raises(ValueError, match="at least one"):
        Spread.of([])
    with pytest.raises(ValueError, match="one length"):
        paired_ratio([1.0, 2.0], [1.0])


def test_time_callable_times_real_work_on_the_cpu():
    ms = time_callable(lambda: sum(range(1000)), warmup=0, repeats=3)
    assert ms > 0


def test_forward_step_records_no_graph_and_forward_backward_step_fills_every_gradient():
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    x = torch.randn(4, 5)
    assert not forward_step(layer, x)().requires_grad
    grad_x, grad_w, grad_b = forward_backward_step(layer, x)()
    assert grad_x.shape == x.shape and grad_w.shape == (3, 5) and grad_b.shape == (3,)
    assert layer.weight.grad is None  # gradients are returned, never accumulated
    with torch.no_grad():  # a step runs its backward even when called under no_grad
        assert len(forward_backward_step(layer, x)()) == 3


@pytest.mark.cuda
def test_time_callable_on_cuda_measures_gpu_work():
    a = torch.randn(2048, 2048, device="cuda")
    small = time_callable(lambda: a[:128, :128] @ a[:128, :128], device="cuda", warmup=2, repeats=5)
    large = time_callable(lambda: a @ a, device="cuda", warmup=2, repeats=5)
    assert 0 < small < large


@pytest.mark.cuda
@pytest.mark.parametrize("flush_cache", [True, False])
def test_time_callable_on_cuda_flushes_a_buffer_larger_than_l2(flush_cache):
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    time_callable(lambda: None, device="cuda", warmup=0, repeats=2, flush_cache=flush_cache)
    scratch = torch.cuda.max_memory_allocated() - before
    assert (scratch > l2_bytes) if flush_cache else (scratch == 0)


@pytest.mark.cuda
def test_time_interleaved_on_cuda_returns_one_sample_per_round():
    a = torch.randn(256, 256, device="cuda")
    samples = time_interleaved({"mm": lambda: a @ a, "add": lambda: a + a}, device="cuda", warmup=1, repeats=4)
    assert all(len(s) == 4 and min(s) > 0 for s in samples.values())
    assert statistics.median(samples["mm"]) > 0
