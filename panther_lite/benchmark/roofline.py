"""Rooflines: a device's measured peak FLOP/s and bandwidth, and the least time a layer
can take at those peaks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .environment import DeviceLike, as_device, check_int
from .timing import time_callable


@dataclass(frozen=True)
class DevicePeaks:
    """Measured peak throughput of a device: ``flops_per_s`` (large GEMM) and
    ``bytes_per_s`` (large copy, read + write)."""

    flops_per_s: float
    bytes_per_s: float


def measure_device_peaks(
    device: DeviceLike = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    *,
    gemm_size: int = 8192,
    copy_bytes: int = 1 << 30,
    warmup: int = 3,
    repeats: int = 10,
) -> DevicePeaks:
    """Peak FLOP/s of a ``gemm_size``³ matmul at ``dtype`` and bandwidth of a ``copy_bytes``
    device-to-device copy (counted as read + write), timed by :func:`time_callable`."""
    device = as_device(device)
    check_int("gemm_size", gemm_size, 1)
    check_int("copy_bytes", copy_bytes, 1)
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    b = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    gemm_ms = time_callable(lambda: torch.mm(a, b), device=device, warmup=warmup, repeats=repeats)
    del a, b
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_ms = time_callable(lambda: dst.copy_(src), device=device, warmup=warmup, repeats=repeats)
    moved = 2 * src.numel() * src.element_size()
    return DevicePeaks(flops_per_s=2.0 * gemm_size**3 / (gemm_ms * 1e-3), bytes_per_s=moved / (copy_ms * 1e-3))


def roofline_ms(flops: float, bytes_moved: float, peaks: DevicePeaks) -> float:
    """The roofline time ``max(flops / peak FLOP/s, bytes / bandwidth)`` in milliseconds."""
    return 1e3 * max(flops / peaks.flops_per_s, bytes_moved / peaks.bytes_per_s)
