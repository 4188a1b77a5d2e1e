"""Measurement library: timing, memory, accuracy, rooflines, sweeps and plots.

* Timing (:func:`time_callable`): warm-up, then the median of repeats — ``perf_counter``
  around each call on the CPU; CUDA events on the current stream, with device
  synchronisation, on the GPU.
* Memory (:func:`training_memory_bytes`): the footprint of a training forward. On CUDA the
  allocator's peak while it runs (plus the module's own bytes); on the CPU the bytes of
  parameters and buffers (:func:`parameter_bytes`) plus the activations autograd saves for
  backward (:func:`saved_activation_bytes`), counted once per storage.
* Accuracy: the relative output error of a sketched layer against the dense layer it
  approximates, whose weight has a trained-like decaying spectrum
  (:func:`structured_weight`); and task accuracy of a small model trained on
  scikit-learn's bundled digits (:func:`digits_task_accuracy`).
* Rooflines (:func:`measure_device_peaks`, :func:`roofline_ms`): peak FLOP/s from a large
  GEMM and bandwidth from a large copy, measured once on the device.
* The anchor's per-term formulation (:func:`anchor_linear`, :func:`anchor_conv2d`) as a
  reference baseline.
* Sweeps (:func:`run_sweep` over a :class:`LinearCase` or :class:`Conv2dCase`) into a
  pandas DataFrame, with every row appended to a CSV and flushed as soon as it is
  measured, and plots (:func:`plot_heatmaps`, :func:`plot_tradeoff`, :func:`pareto_front`).
"""
from __future__ import annotations

import abc
import contextlib
import csv
import itertools
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from .nn.low_rank_fit import relative_error
from .nn.rank_selection import dense_size
from .nn.skconv2d import SKConv2d
from .nn.sklinear import INITS, SKLinear

__all__ = [
    "time_callable",
    "ignore_size_warnings",
    "parameter_bytes",
    "saved_activation_bytes",
    "training_memory_bytes",
    "structured_weight",
    "relative_output_error",
    "anchor_linear",
    "anchor_conv2d",
    "DevicePeaks",
    "measure_device_peaks",
    "roofline_ms",
    "GemmShape",
    "LinearCase",
    "Conv2dCase",
    "SWEEP_COLUMNS",
    "device_name",
    "run_sweep",
    "digits_task_accuracy",
    "pareto_front",
    "plot_heatmaps",
    "plot_tradeoff",
]

DeviceLike = Union[str, torch.device]
_L2_FLUSH_BYTES = 256 * 1024 * 1024  # over any current GPU's L2 (H100: 50 MB, B200: 126 MB)


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _device(device: DeviceLike) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    return device


@contextlib.contextmanager
def ignore_size_warnings():
    """Silence the layers' warning that a configuration stores more than the dense layer
    (a sweep measures such configurations on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*more than the dense layer.*", category=UserWarning)
        yield


# --------------------------------------------------------------------------- timing


def time_callable(
    fn: Callable[[], object],
    *,
    device: DeviceLike = "cpu",
    warmup: int = 3,
    repeats: int = 10,
    flush_cache: bool = True,
) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    Args:
        fn: a callable taking no arguments (its result is discarded).
        device: where ``fn`` runs. ``"cpu"`` times each call with ``time.perf_counter``;
            a CUDA device records CUDA events around each call on the current stream
            and synchronises before timing and before reading the events.
        warmup: untimed calls first (allocator, kernel selection, caches).
        repeats: timed calls; the median is returned.
        flush_cache: on CUDA, overwrite a buffer larger than the L2 cache before each
            timed call (outside the events), so inputs that would fit in L2 (e.g. 32 MB
            on an H100's 50 MB) are read from device memory as the roofline assumes.
    """
    _check_int("warmup", warmup, 0)
    _check_int("repeats", repeats, 1)
    device = _device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        with torch.cuda.device(device):
            scratch = torch.empty(_L2_FLUSH_BYTES, dtype=torch.int8, device=device) if flush_cache else None
            torch.cuda.synchronize()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
            for start, end in zip(starts, ends):
                if scratch is not None:
                    scratch.zero_()
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


# --------------------------------------------------------------------------- memory


def _storage_key(t: Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr())


def _storage_bytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each storage counted once
    (tied or aliased tensors are not double-counted)."""
    seen = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        seen.setdefault(_storage_key(t), _storage_bytes(t))
    return sum(seen.values())


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[Tensor] = ()) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs.

    Every tensor packed by autograd is counted by its whole storage, once per storage
    (a saved view and its base, or a tensor saved by two ops, count once). Tensors
    sharing a storage with one in ``exclude`` (typically the module's parameters and
    buffers, which exist anyway) are not counted.

    Args:
        fn: runs the forward with autograd recording (its result is discarded).
        exclude: tensors whose storages are not activations.
    """
    skip = {_storage_key(t) for t in exclude}
    seen: Dict[tuple, int] = {}
    alive: List[Tensor] = []  # holds saved tensors so that no storage address is reused meanwhile

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in skip and key not in seen:
            seen[key] = _storage_bytes(t)
            alive.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def training_memory_bytes(module: nn.Module, *inputs: Tensor) -> int:
    """Memory footprint in bytes of ``module(*inputs)`` with autograd recording.

    CUDA: the allocator's peak above what was allocated before the call, plus
    :func:`parameter_bytes` of the module (so temporaries, the output and the saved
    activations all count). CPU: :func:`parameter_bytes` plus
    :func:`saved_activation_bytes` of the forward.
    """
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    device = inputs[0].device if inputs else (tensors[0].device if tensors else torch.device("cpu"))
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.enable_grad():
                module(*inputs)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
        return int(extra) + parameter_bytes(module)

    def forward() -> None:
        with torch.enable_grad():
            module(*inputs)

    return parameter_bytes(module) + saved_activation_bytes(forward, tensors)


# --------------------------------------------------------------------------- accuracy


def _random_orthonormal(rows: int, cols: int, generator: torch.Generator, device: Optional[DeviceLike]) -> Tensor:
    """``(rows, cols)`` float64 with orthonormal columns, Haar-distributed: the QR (on
    ``device``) of a Gaussian drawn on the CPU from ``generator``."""
    gaussian = torch.randn(rows, cols, generator=generator, dtype=torch.float64).to(device)
    q, r = torch.linalg.qr(gaussian)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)


def structured_weight(
    out_features: int,
    in_features: int,
    *,
    decay: float = 1.0,
    seed: int = 0,
    dtype: Optional[torch.dtype] = None,
    device: Optional[DeviceLike] = None,
) -> Tensor:
    """A trained-like dense weight ``(out_features, in_features)``: ``Q1 · diag(σ) · Q2ᵀ``
    with random orthonormal ``Q1``, ``Q2`` and singular values ``σ_i ∝ i^-decay``.

    It is scaled to the Frobenius norm ``nn.Linear``'s init has on average
    (``‖W‖_F² = out_features / 3``), so outputs have the usual magnitude. The Gaussians
    are drawn on the CPU from ``seed`` (the same weight on every device), factored and
    multiplied in float64 on ``device``, then cast to ``dtype``.
    """
    _check_int("out_features", out_features, 1)
    _check_int("in_features", in_features, 1)
    if not decay >= 0:
        raise ValueError(f"decay must be >= 0, got {decay!r}")
    rank = min(out_features, in_features)
    generator = torch.Generator().manual_seed(int(seed))
    left = _random_orthonormal(out_features, rank, generator, device)
    right = _random_orthonormal(in_features, rank, generator, device)
    sigma = torch.arange(1, rank + 1, dtype=torch.float64, device=left.device).pow(-float(decay))
    sigma *= math.sqrt(out_features / 3.0) / sigma.norm()
    weight = (left * sigma) @ right.t()
    return weight.to(dtype=dtype or torch.get_default_dtype(), device=device)


@torch.no_grad()
def relative_output_error(approx: Callable[[Tensor], Tensor], exact: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """``‖approx(x) − exact(x)‖_F / ‖exact(x)‖_F``, computed in float64."""
    return relative_error(approx(x), exact(x))


# --------------------------------------------------------------------------- anchor formulation


def anchor_linear(layer: SKLinear) -> Callable[[Tensor], Tensor]:
    """The anchor's (Panther's) per-term forward of ``layer``, as a function of ``x`` (batch × in).

    Contiguous per-term copies ``S1s`` (L, in, k), ``U1s`` (L, k, out), ``U2s`` (L, in, k),
    ``S2s`` (L, k, out) are made once (the anchor's storage layout); the forward expands
    ``x`` over the ``L`` terms, runs two ``bmm`` chains that materialise ``L × batch × out``
    per-term outputs, and averages: ``mean_L(x S1_i U1_i + x U2_i S2_i) / 2 + b``.
    """
    S1s, U1s, U2s, S2s = (t.detach().contiguous() for t in (layer.S1s, layer.U1s, layer.U2s, layer.S2s))
    bias = None if layer.bias is None else layer.bias.detach()
    num_terms = layer.num_terms

    def forward(x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"the anchor formulation takes x of shape (batch, in), got {tuple(x.shape)}")
        xs = x.unsqueeze(0).expand(num_terms, *x.shape)
        out = (torch.bmm(torch.bmm(xs, S1s), U1s) + torch.bmm(torch.bmm(xs, U2s), S2s)).mean(0) / 2
        return out if bias is None else out + bias

    return forward


def anchor_conv2d(layer: SKConv2d) -> Callable[[Tensor], Tensor]:
    """The per-term forward of ``layer`` (zero padding only): each of the ``2L`` terms is
    a convolution with its kernel ``S_i`` (k channels) and a 1×1 convolution with
    ``U_iᵀ`` back to ``C_out``; the ``2L × N × C_out × H × W`` outputs are averaged."""
    if layer.padding_mode != "zeros":
        raise ValueError(f"the per-term formulation supports padding_mode='zeros' only, got {layer.padding_mode!r}")
    kernels = [s.detach().contiguous() for s in layer.Ss.unbind(0)]
    mixes = [u.detach().t().contiguous()[:, :, None, None] for u in layer.Us.unbind(0)]
    bias = None if layer.bias is None else layer.bias.detach()
    options = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation)

    def forward(x: Tensor) -> Tensor:
        outs = torch.stack([F.conv2d(F.conv2d(x, s, None, **options), u) for s, u in zip(kernels, mixes)])
        out = outs.mean(0)
        return out if bias is None else out + bias[:, None, None]

    return forward


# --------------------------------------------------------------------------- roofline


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
    device = _device(device)
    _check_int("gemm_size", gemm_size, 1)
    _check_int("copy_bytes", copy_bytes, 1)
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


# --------------------------------------------------------------------------- layer cases


class GemmShape(NamedTuple):
    """A layer as a GEMM: ``rows × fan_in`` input rows times a ``fan_in × fan_out``
    weight, plus the entries of the layer's actual input and output tensors."""

    rows: int
    fan_in: int
    fan_out: int
    input_numel: int
    output_numel: int


class _Case(abc.ABC):
    """A dense layer shape and its sketched replacements, as a GEMM (:class:`GemmShape`):
    dense ``rows × fan_in × fan_out``, sketched a rank-``2Lk`` product (GEMMs of total width ``2Lk``)."""

    layer = ""

    @property
    @abc.abstractmethod
    def gemm(self) -> GemmShape:
        """The layer's shape as a GEMM."""

    def dense_flops(self) -> int:
        """``2 · rows · fan_in · fan_out``."""
        g = self.gemm
        return 2 * g.rows * g.fan_in * g.fan_out

    def sketch_flops(self, num_terms: int, low_rank: int) -> int:
        """``2 · rows · 2Lk · (fan_in + fan_out)``."""
        g = self.gemm
        return 2 * g.rows * 2 * num_terms * low_rank * (g.fan_in + g.fan_out)

    def dense_bytes(self, element_size: int) -> int:
        """Least traffic of the dense forward: input, weight, bias and output once."""
        g = self.gemm
        return element_size * (g.input_numel + dense_size(g.fan_in, g.fan_out) + g.output_numel)

    def sketch_bytes(self, num_terms: int, low_rank: int, element_size: int) -> int:
        """Least traffic of the sketched forward: input, the four factors, bias, output
        once, and the ``rows × 2Lk`` activations (``x·S1``, ``x·U2``) written and read back."""
        g = self.gemm
        width = 2 * num_terms * low_rank
        factors = width * (g.fan_in + g.fan_out) + g.fan_out
        return element_size * (g.input_numel + factors + g.output_numel + 2 * g.rows * width)

    @abc.abstractmethod
    def describe(self) -> Dict[str, object]:
        """The shape columns of a sweep row."""

    @abc.abstractmethod
    def dense_module(self, weight: Tensor, generator: torch.Generator) -> nn.Module:
        """The dense layer with ``weight`` (fan_out × fan_in) and a bias from ``generator``."""

    @abc.abstractmethod
    def sketched_module(self, dense: nn.Module, num_terms: int, low_rank: int, init: str, seed: int) -> nn.Module:
        """The sketched layer approximating ``dense``."""

    @abc.abstractmethod
    def make_input(self, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A standard normal input."""

    @abc.abstractmethod
    def anchor(self, layer: nn.Module) -> Callable[[Tensor], Tensor]:
        """The anchor's per-term forward of the sketched ``layer``."""


def _uniform_bias(fan_in: int, fan_out: int, generator: torch.Generator) -> Tensor:
    bound = 1 / math.sqrt(fan_in)
    return (torch.rand(fan_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound


@dataclass(frozen=True)
class LinearCase(_Case):
    """``nn.Linear(in_features, out_features)`` on a ``(batch_size, in_features)`` input,
    against ``SKLinear``."""

    in_features: int
    out_features: int
    batch_size: int

    layer = "linear"

    def __post_init__(self) -> None:
        for name in ("in_features", "out_features", "batch_size"):
            _check_int(name, getattr(self, name), 1)

    @property
    def gemm(self) -> GemmShape:
        b, i, o = self.batch_size, self.in_features, self.out_features
        return GemmShape(rows=b, fan_in=i, fan_out=o, input_numel=b * i, output_numel=b * o)

    def describe(self) -> Dict[str, object]:
        return dict(in_features=self.in_features, out_features=self.out_features, batch_size=self.batch_size)

    def dense_module(self, weight: Tensor, generator: torch.Generator) -> nn.Linear:
        """``nn.Linear`` with ``weight`` (out × in) and a seeded ``nn.Linear``-style bias."""
        dense = nn.Linear(self.in_features, self.out_features, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            dense.bias.copy_(_uniform_bias(self.in_features, self.out_features, generator))
        return dense

    def sketched_module(self, dense: nn.Linear, num_terms: int, low_rank: int, init: str, seed: int) -> SKLinear:
        return SKLinear.from_linear(dense, num_terms, low_rank, init=init, seed=seed)

    def make_input(self, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Standard normal ``(batch_size, in_features)``."""
        x = torch.randn(self.batch_size, self.in_features, generator=generator)
        return x.to(dtype=dtype, device=device)

    def anchor(self, layer: SKLinear) -> Callable[[Tensor], Tensor]:
        return anchor_linear(layer)


@dataclass(frozen=True)
class Conv2dCase(_Case):
    """``nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)`` on a
    ``(batch_size, in_channels, image_size, image_size)`` input, against ``SKConv2d``.
    As a GEMM: ``rows = batch·H_out·W_out``, ``fan_in = C_in·k²``, ``fan_out = C_out``."""

    in_channels: int
    out_channels: int
    batch_size: int
    image_size: int
    kernel_size: int = 3

    layer = "conv2d"

    def __post_init__(self) -> None:
        for name in ("in_channels", "out_channels", "batch_size", "image_size", "kernel_size"):
            _check_int(name, getattr(self, name), 1)

    @property
    def padding(self) -> int:
        return self.kernel_size // 2

    @property
    def output_size(self) -> int:
        return self.image_size + 2 * self.padding - self.kernel_size + 1

    @property
    def gemm(self) -> GemmShape:
        rows = self.batch_size * self.output_size**2
        return GemmShape(
            rows=rows,
            fan_in=self.in_channels * self.kernel_size**2,
            fan_out=self.out_channels,
            input_numel=self.batch_size * self.in_channels * self.image_size**2,
            output_numel=rows * self.out_channels,
        )

    def describe(self) -> Dict[str, object]:
        return dict(
            in_features=self.in_channels,
            out_features=self.out_channels,
            batch_size=self.batch_size,
            kernel_size=self.kernel_size,
            image_size=self.image_size,
        )

    def dense_module(self, weight: Tensor, generator: torch.Generator) -> nn.Conv2d:
        """``nn.Conv2d`` whose kernel unfolds to ``weight`` (C_out × C_in·k²), seeded bias."""
        dense = nn.Conv2d(
            self.in_channels, self.out_channels, self.kernel_size, padding=self.padding,
            device=weight.device, dtype=weight.dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(weight.view_as(dense.weight))
            dense.bias.copy_(_uniform_bias(self.gemm.fan_in, self.out_channels, generator))
        return dense

    def sketched_module(self, dense: nn.Conv2d, num_terms: int, low_rank: int, init: str, seed: int) -> SKConv2d:
        return SKConv2d.from_conv2d(dense, num_terms, low_rank, init=init, seed=seed)

    def make_input(self, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Standard normal ``(batch_size, in_channels, image_size, image_size)``."""
        x = torch.randn(self.batch_size, self.in_channels, self.image_size, self.image_size, generator=generator)
        return x.to(dtype=dtype, device=device)

    def anchor(self, layer: SKConv2d) -> Callable[[Tensor], Tensor]:
        return anchor_conv2d(layer)


# --------------------------------------------------------------------------- task accuracy


def _digits(device: torch.device, seed: int, test_fraction: float = 0.25):
    """scikit-learn's bundled 8×8 digits (no download), scaled to [0, 1], split at random."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).div_(16.0)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return x[train].to(device), y[train].to(device), x[test].to(device), y[test].to(device)


def _digits_model(layer: str, width: int, num_terms: Optional[int], low_rank: Optional[int], seed: int) -> nn.Module:
    """A small digits classifier whose middle layer (width → width) is dense when
    ``num_terms`` is None, sketched (``init="sketch"``, trained from scratch) otherwise.
    Initialised from ``seed`` without touching the global random state."""
    with torch.random.fork_rng(devices=[]), ignore_size_warnings():
        torch.default_generator.manual_seed(seed)  # the CPU's only: torch.manual_seed also reseeds CUDA's
        if layer == "linear":
            middle = (
                nn.Linear(width, width)
                if num_terms is None
                else SKLinear(width, width, num_terms, low_rank, seed=seed)
            )
            return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), middle, nn.ReLU(), nn.Linear(width, 10))
        middle = (
            nn.Conv2d(width, width, 3, padding=1)
            if num_terms is None
            else SKConv2d(width, width, 3, padding=1, num_terms=num_terms, low_rank=low_rank, seed=seed)
        )
        return nn.Sequential(
            nn.Unflatten(1, (1, 8)),
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            middle,
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * width, 10),
        )


def digits_task_accuracy(
    layer: str = "linear",
    num_terms: Optional[int] = None,
    low_rank: Optional[int] = None,
    *,
    width: int = 128,
    epochs: int = 20,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    device: DeviceLike = "cpu",
) -> float:
    """Test accuracy (fraction in [0, 1]) of a small model trained on the digits.

    ``layer="linear"``: an MLP 64 → width → width → 10 whose middle layer is an
    ``SKLinear(width, width, num_terms, low_rank)``; ``layer="conv2d"``: a CNN on the 8×8
    images whose middle 3×3 convolution (width → width channels) is an ``SKConv2d``.
    ``num_terms=None`` trains the dense model. Adam, float32, seeded split and init.
    """
    if layer not in ("linear", "conv2d"):
        raise ValueError(f"layer must be 'linear' or 'conv2d', got {layer!r}")
    if (num_terms is None) != (low_rank is None):
        raise ValueError("give both num_terms and low_rank (sketched) or neither (dense)")
    for name, value in (("width", width), ("epochs", epochs), ("batch_size", batch_size)):
        _check_int(name, value, 1)
    device = _device(device)
    x_train, y_train, x_test, y_test = _digits(device, seed)
    model = _digits_model(layer, width, num_terms, low_rank, seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y_train), generator=generator).split(batch_size):
            batch = batch.to(device)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        return float((model(x_test).argmax(1) == y_test).float().mean())


# --------------------------------------------------------------------------- sweeps

ERROR_COLUMNS = tuple(f"error_{init}" for init in INITS)

SWEEP_COLUMNS = (
    "layer",
    "method",
    "device",
    "device_name",
    "dtype",
    "in_features",
    "out_features",
    "batch_size",
    "kernel_size",
    "image_size",
    "num_terms",
    "low_rank",
    "rank",
    "trainable_params",
    "stored_params",
    "forward_ms",
    "forward_backward_ms",
    "peak_memory_bytes",
    *ERROR_COLUMNS,
    "speedup",
    "speedup_forward_backward",
    "memory_ratio",
    "anchor_forward_ms",
    "anchor_speedup",
    "flops",
    "roofline_ms",
    "roofline_fraction",
    "task_accuracy",
)
"""Columns of a sweep's CSV and DataFrame (one row per configuration plus a dense row).

``rank`` is ``2Lk``; ``trainable_params``/``stored_params`` count parameters without/with
the fixed sketch buffers; ``peak_memory_bytes`` is :func:`training_memory_bytes`;
``error_<init>`` the relative output error of that init against the dense layer;
``speedup`` = dense / sketched forward time (``speedup_forward_backward`` likewise);
``memory_ratio`` = sketched / dense memory; ``anchor_speedup`` = anchor / sketched
forward time; ``roofline_fraction`` = roofline time / forward time (CUDA only, else
empty); ``task_accuracy`` only with ``task_accuracy=True``."""


def device_name(device: DeviceLike) -> str:
    """The accelerator's name, or the CPU's with the number of threads torch uses."""
    device = _device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()} ({torch.get_num_threads()} threads)"


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class _CsvRows:
    """Writes rows to a CSV with fixed columns, flushing after each row (an interrupted
    sweep keeps every row it finished)."""

    def __init__(self, path: Optional[Path], columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self.file = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w", newline="")
            self.writer = csv.DictWriter(self.file, fieldnames=self.columns)
            self.writer.writeheader()
            self.file.flush()

    def write(self, row: Dict[str, object]) -> None:
        if self.file is not None:
            self.writer.writerow({c: "" if _missing(row.get(c)) else row.get(c) for c in self.columns})
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _forward_backward(module: nn.Module, x: Tensor, grad_out: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(grad_out)


def _measure(module: nn.Module, x: Tensor, device: torch.device, warmup: int, repeats: int) -> Dict[str, float]:
    """Forward (no grad) and forward+backward times and the training-forward memory."""
    with torch.no_grad():
        grad_out = torch.randn_like(module(x))
    x_grad = x.detach().clone().requires_grad_(True)

    def forward() -> None:
        with torch.no_grad():
            module(x)

    return dict(
        forward_ms=time_callable(forward, device=device, warmup=warmup, repeats=repeats),
        forward_backward_ms=time_callable(
            lambda: _forward_backward(module, x_grad, grad_out), device=device, warmup=warmup, repeats=repeats
        ),
        peak_memory_bytes=training_memory_bytes(module, x_grad),
    )


def run_sweep(
    case: _Case,
    num_terms: Sequence[int],
    low_rank: Sequence[int],
    *,
    device: DeviceLike = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
    decay: float = 1.0,
    csv_path: Optional[Union[str, Path]] = None,
    progress: bool = True,
    task_accuracy: bool = False,
    task_width: int = 128,
    task_epochs: int = 20,
    peaks: Optional[DevicePeaks] = None,
    on_row: Optional[Callable[[Dict[str, object]], None]] = None,
) -> pd.DataFrame:
    """Measure the dense layer of ``case`` and its sketched replacement at every
    ``(num_terms, low_rank)`` of the grid; returns a DataFrame with :data:`SWEEP_COLUMNS`.

    The dense layer's weight is :func:`structured_weight` (singular values ``∝ i^-decay``);
    for each configuration the sketched layer is built from it with every init
    (``"sketch"`` and ``"svd"``) for the ``error_<init>`` columns, and the ``"svd"`` one is
    timed (speed does not depend on the init) along with the anchor's formulation.

    Args:
        case: a :class:`LinearCase` or :class:`Conv2dCase`.
        num_terms, low_rank: the grid (``L`` values × ``k`` values).
        device, dtype: where and at which dtype every layer runs.
        warmup, repeats: passed to :func:`time_callable`.
        seed: seeds the weight, bias, input and sketches.
        csv_path: if given, the CSV is (re)written with a header and each row is
            appended and flushed as soon as it is measured.
        progress: show a tqdm bar on stderr.
        task_accuracy: also train :func:`digits_task_accuracy` per configuration
            (``task_width``, ``task_epochs``).
        peaks: the device's :class:`DevicePeaks` for the roofline columns; measured once
            here on CUDA (at ``dtype``) when None. Without peaks (CPU) the roofline columns are empty.
        on_row: called with each row (a dict) after it is written.
    """
    if not isinstance(case, _Case):
        raise TypeError(f"case must be a LinearCase or Conv2dCase, got {type(case).__name__}")
    num_terms, low_rank = list(num_terms), list(low_rank)
    if not num_terms or not low_rank:
        raise ValueError("num_terms and low_rank must each hold at least one value")
    for value in num_terms:
        _check_int("every num_terms", value, 1)
    for value in low_rank:
        _check_int("every low_rank", value, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = _device(device)
    if peaks is None and device.type == "cuda":
        peaks = measure_device_peaks(device, dtype)

    generator = torch.Generator().manual_seed(seed)
    shape = case.gemm
    weight = structured_weight(shape.fan_out, shape.fan_in, decay=decay, seed=seed, dtype=dtype, device=device)
    dense = case.dense_module(weight, generator)
    x = case.make_input(generator, dtype, device)
    element_size = weight.element_size()
    base = dict(
        layer=case.layer, device=str(device), device_name=device_name(device), dtype=str(dtype).removeprefix("torch."),
        **case.describe(),
    )
    rows: List[Dict[str, object]] = []
    writer = _CsvRows(None if csv_path is None else Path(csv_path), SWEEP_COLUMNS)
    bar = tqdm(total=1 + len(num_terms) * len(low_rank), file=sys.stderr, disable=not progress, desc=f"{case.layer} sweep")

    def finish(row: Dict[str, object]) -> None:
        if peaks is not None:
            row["roofline_ms"] = roofline_ms(row["flops"], row.pop("bytes"), peaks)
            row["roofline_fraction"] = row["roofline_ms"] / row["forward_ms"]
        else:
            row.pop("bytes")
        rows.append(row)
        writer.write(row)
        bar.update()
        if on_row is not None:
            on_row(row)

    try:
        dense_size_ = dense_size(shape.fan_in, shape.fan_out)
        reference = _measure(dense, x, device, warmup, repeats)
        dense_row = dict(
            base, method="dense", rank=min(shape.fan_in, shape.fan_out), trainable_params=dense_size_,
            stored_params=dense_size_, **reference, **{c: 0.0 for c in ERROR_COLUMNS}, speedup=1.0,
            speedup_forward_backward=1.0, memory_ratio=1.0, flops=case.dense_flops(),
            bytes=case.dense_bytes(element_size),
        )
        if task_accuracy:
            dense_row["task_accuracy"] = digits_task_accuracy(
                case.layer, width=task_width, epochs=task_epochs, seed=seed, device=device
            )
        finish(dense_row)
        for L, k in itertools.product(num_terms, low_rank):
            bar.set_postfix(num_terms=L, low_rank=k)
            with ignore_size_warnings():
                layers = {init: case.sketched_module(dense, L, k, init, seed) for init in INITS}
            timed = layers["svd"]
            counts = timed.parameter_counts()
            measured = _measure(timed, x, device, warmup, repeats)
            anchor = case.anchor(timed)
            with torch.no_grad():
                anchor_ms = time_callable(lambda: anchor(x), device=device, warmup=warmup, repeats=repeats)
            row = dict(
                base, method="sketched", num_terms=L, low_rank=k, rank=2 * L * k,
                trainable_params=counts.trainable, stored_params=counts.stored, **measured,
                **{f"error_{init}": relative_output_error(layer, dense, x) for init, layer in layers.items()},
                speedup=reference["forward_ms"] / measured["forward_ms"],
                speedup_forward_backward=reference["forward_backward_ms"] / measured["forward_backward_ms"],
                memory_ratio=measured["peak_memory_bytes"] / reference["peak_memory_bytes"],
                anchor_forward_ms=anchor_ms, anchor_speedup=anchor_ms / measured["forward_ms"],
                flops=case.sketch_flops(L, k), bytes=case.sketch_bytes(L, k, element_size),
            )
            if task_accuracy:
                row["task_accuracy"] = digits_task_accuracy(
                    case.layer, L, k, width=task_width, epochs=task_epochs, seed=seed, device=device
                )
            finish(row)
    finally:
        bar.close()
        writer.close()
    return pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


# --------------------------------------------------------------------------- plots


def pareto_front(times: Sequence[float], errors: Sequence[float]) -> np.ndarray:
    """Boolean mask of the points no other point dominates (both time and error lower or
    equal, one strictly lower): the best accuracy-versus-time trade-offs."""
    t = np.asarray(times, dtype=float)
    e = np.asarray(errors, dtype=float)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"times and errors must be 1-D of one length, got shapes {t.shape} and {e.shape}")
    no_worse = (t[None, :] <= t[:, None]) & (e[None, :] <= e[:, None])
    better = (t[None, :] < t[:, None]) | (e[None, :] < e[:, None])
    return ~(no_worse & better).any(axis=1)


_HEATMAPS = (
    ("speedup", "forward speed-up over dense (×)", "RdYlGn"),
    ("speedup_forward_backward", "fwd+bwd speed-up over dense (×)", "RdYlGn"),
    ("memory_ratio", "memory / dense memory", "RdYlGn_r"),
    *((f"error_{init}", f"relative output error, init='{init}'", "viridis_r") for init in INITS),
    ("anchor_speedup", "speed-up over the anchor formulation (×)", "RdYlGn"),
    ("roofline_fraction", "fraction of roofline", "RdYlGn"),
    ("task_accuracy", "digits test accuracy", "viridis"),
)


def _figure(**kwargs):
    """A matplotlib Figure that is never registered with pyplot, so plotting neither
    needs a display nor changes the caller's backend."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig, path: Union[str, Path]) -> Path:
    """Save ``fig`` as a PNG at ``path`` (creating its folder), return the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _sketched(df: pd.DataFrame) -> pd.DataFrame:
    sketched = df[df["method"] == "sketched"]
    if sketched.empty:
        raise ValueError("the sweep has no sketched rows to plot")
    return sketched


def _title(df: pd.DataFrame) -> str:
    first = df.iloc[0]
    shape = f"{first['in_features']}→{first['out_features']}, batch {first['batch_size']}"
    if first["layer"] == "conv2d":
        shape += f", {first['kernel_size']}×{first['kernel_size']} kernel, {first['image_size']}² images"
    return f"{first['layer']} {shape}, {first['dtype']}, {first['device_name']}"


def plot_heatmaps(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Heatmaps over the ``num_terms × low_rank`` grid of every metric the sweep has
    (speed-ups, memory ratio, errors per init, anchor speed-up, roofline fraction, task
    accuracy); saves a PNG at ``path`` and returns it."""
    sketched = _sketched(df)
    panels = [p for p in _HEATMAPS if p[0] in sketched and sketched[p[0]].notna().any()]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = _figure(figsize=(4.6 * ncols, 3.8 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (column, label, cmap) in zip(axes.flat, panels):
        grid = sketched.pivot_table(index="num_terms", columns="low_rank", values=column, aggfunc="mean")
        image = ax.imshow(grid.to_numpy(dtype=float), cmap=cmap, aspect="auto", origin="lower")
        ax.set_xticks(range(grid.shape[1]), [str(int(c)) for c in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [str(int(i)) for i in grid.index])
        ax.set_xlabel("low_rank k")
        ax.set_ylabel("num_terms L")
        ax.set_title(label, fontsize=10)
        for (i, j), value in np.ndenumerate(grid.to_numpy(dtype=float)):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(_title(df), fontsize=11)
    return _save(fig, path)


def plot_tradeoff(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Relative output error against forward time, one series per init, with each
    init's Pareto front drawn and marked and the dense layer's time as a line; saves a
    PNG at ``path`` and returns it."""
    sketched = _sketched(df)
    fig = _figure(figsize=(7.5, 5))
    ax = fig.subplots()
    for init, colour, label_offset in zip(INITS, ("tab:orange", "tab:blue"), ((5, 6), (5, -12))):
        column = f"error_{init}"
        points = sketched[["forward_ms", column, "num_terms", "low_rank"]].dropna()
        if points.empty:
            continue
        ax.scatter(points["forward_ms"], points[column], color=colour, alpha=0.45, label=f"init='{init}'")
        front = points[pareto_front(points["forward_ms"], points[column])].sort_values("forward_ms")
        ax.plot(front["forward_ms"], front[column], "-o", color=colour, markerfacecolor="none", markersize=11,
                label=f"Pareto front, init='{init}'")
        labelled = []
        for _, p in front.iterrows():
            where = (math.log10(p["forward_ms"]), math.log10(max(p[column], 1e-30)))
            if any(abs(where[0] - x) < 0.12 and abs(where[1] - y) < 0.2 for x, y in labelled):
                continue  # a neighbour on the front already carries a label here
            labelled.append(where)
            ax.annotate(f"L={int(p['num_terms'])},k={int(p['low_rank'])}", (p["forward_ms"], p[column]),
                        textcoords="offset points", xytext=label_offset, fontsize=7)
    dense = df[df["method"] == "dense"]
    if not dense.empty:
        ax.axvline(float(dense["forward_ms"].iloc[0]), color="black", linestyle="--", label="dense forward time")
    ax.set_xlabel("forward time (ms)")
    ax.set_ylabel("relative output error vs dense")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a short log axis
    ax.set_title(_title(df), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)
