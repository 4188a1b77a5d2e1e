"""Layer cases and rooflines: FLOP counts follow DESIGN.md §4, the roofline is the slower
of compute and memory, and device peaks are measured."""
from __future__ import annotations

import pytest
import torch

from panther_lite.benchmark import (
    Conv2dCase,
    DevicePeaks,
    LinearCase,
    ignore_size_warnings,
    measure_device_peaks,
    roofline_ms,
)


def test_case_flops_follow_the_design_formula():
    case = LinearCase(300, 200, 16)
    assert case.dense_flops() == 2 * 16 * 300 * 200
    assert case.sketch_flops(2, 8) == 2 * 16 * 2 * 2 * 8 * (300 + 200)
    conv = Conv2dCase(4, 6, batch_size=2, image_size=5, kernel_size=3)
    assert conv.gemm == (2 * 5 * 5, 36, 6, 2 * 4 * 25, 2 * 25 * 6)
    assert conv.dense_flops() == 2 * 50 * 36 * 6


def test_cases_build_matching_dense_and_sketched_layers():
    case = LinearCase(12, 8, 3)
    generator = torch.Generator().manual_seed(0)
    dense = case.dense_module(torch.randn(8, 12, dtype=torch.float64), generator)
    x = case.make_input(generator, torch.float64, torch.device("cpu"))
    with ignore_size_warnings():  # rank 2Lk = 8 = min(in, out): an exact fit, larger than dense
        exact = case.sketched_module(dense, 2, 2, "svd", 0)
    torch.testing.assert_close(exact(x), dense(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(case.anchor(exact)(x), dense(x), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="batch_size"):
        LinearCase(4, 4, 0)


def test_roofline_is_the_slower_of_compute_and_memory():
    peaks = DevicePeaks(flops_per_s=1e12, bytes_per_s=1e11)
    assert roofline_ms(2e9, 1e6, peaks) == pytest.approx(2.0)  # compute bound: 2 ms
    assert roofline_ms(1e6, 5e8, peaks) == pytest.approx(5.0)  # memory bound: 5 ms


def test_measure_device_peaks_on_cpu_is_positive():
    peaks = measure_device_peaks("cpu", torch.float32, gemm_size=64, copy_bytes=1 << 16, warmup=1, repeats=2)
    assert peaks.flops_per_s > 0 and peaks.bytes_per_s > 0


@pytest.mark.cuda
def test_measure_device_peaks_on_cuda_is_plausible():
    peaks = measure_device_peaks("cuda", torch.bfloat16, gemm_size=4096, copy_bytes=1 << 28)
    assert 1e12 < peaks.flops_per_s < 1e16  # 1 TFLOP/s to 10 PFLOP/s
    assert 1e10 < peaks.bytes_per_s < 1e14  # 10 GB/s to 100 TB/s
