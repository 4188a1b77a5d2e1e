"""Layer cases: a dense layer shape and its sketched replacements, as a GEMM — the dense
and sketched modules, an input, FLOP and byte counts and the anchor's formulation."""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from ..nn import SKConv2d, SKLinear, dense_size
from .anchor import anchor_conv2d, anchor_linear
from .environment import check_int


class GemmShape(NamedTuple):
    """A layer as a GEMM: ``rows × fan_in`` input rows times a ``fan_in × fan_out``
    weight, plus the entries of the layer's actual input and output tensors."""

    rows: int
    fan_in: int
    fan_out: int
    input_numel: int
    output_numel: int


class LayerCase(abc.ABC):
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
class LinearCase(LayerCase):
    """``nn.Linear(in_features, out_features)`` on a ``(batch_size, in_features)`` input,
    against ``SKLinear``."""

    in_features: int
    out_features: int
    batch_size: int

    layer = "linear"

    def __post_init__(self) -> None:
        for name in ("in_features", "out_features", "batch_size"):
            check_int(name, getattr(self, name), 1)

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
class Conv2dCase(LayerCase):
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
            check_int(name, getattr(self, name), 1)

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
