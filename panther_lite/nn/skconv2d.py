"""SKConv2d: a drop-in replacement for ``nn.Conv2d`` whose kernel is a sum of sketched terms."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.utils import _pair

from ..sketch.dense import sign_matrix
from ..sketch.random import check_seed, resolve_generator
from .default_init import draw_dense_default, fill_bias_default_, rescale_to_default_
from .low_rank_fit import decomposition_dtype, output_subspace
from .rank_selection import SketchSize, dense_size, sketch_size
from .sklinear import check_gram, check_sketch_args, warn_if_larger_than_dense

__all__ = ["SKConv2d", "conv_sketch_size"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
PADDING_STRINGS = ("same", "valid")

_IntOrPair = Union[int, Tuple[int, int]]


def _positive_pair(name: str, value: _IntOrPair) -> Tuple[int, int]:
    """``value`` as a pair of positive ints (ValueError naming ``name`` otherwise)."""
    pair = _pair(value)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of positive ints, got {value!r}")
    return tuple(pair)


def _padding_arg(padding: Union[str, _IntOrPair]) -> Union[str, Tuple[int, int]]:
    """``padding`` as ``"same"``/``"valid"`` or a pair of non-negative ints."""
    if isinstance(padding, str):
        if padding not in PADDING_STRINGS:
            raise ValueError(f"padding must be an int, a pair of ints or one of {PADDING_STRINGS}, got {padding!r}")
        return padding
    pair = _pair(padding)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in pair):
        raise ValueError(f"padding must be a non-negative int, a pair of them or one of {PADDING_STRINGS}, got {padding!r}")
    return tuple(pair)


def _reversed_padding(
    padding: Union[str, Tuple[int, int]], kernel_size: Tuple[int, int], dilation: Tuple[int, int]
) -> Tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` padding for ``F.pad``, as ``nn.Conv2d`` computes it:
    ``"same"`` puts ``total // 2`` before and the rest after (asymmetric for even kernels),
    exactly like ``F.conv2d(padding="same")``."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        pads = []
        for d, k in zip(reversed(dilation), reversed(kernel_size)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    return (padding[1], padding[1], padding[0], padding[0])


def conv_sketch_size(fan_in: int, fan_out: int, num_terms: int, low_rank: int, bias: bool = True) -> SketchSize:
    """Parameter counts of an SKConv2d with ``fan_in = C_in·kh·kw`` and ``fan_out = C_out``.

    ``stored`` (``2Lk·(fan_in + fan_out)`` + bias) is :func:`sketch_size`'s. ``trainable``
    is ``2Lk·fan_in`` + bias, not ``sketch_size``'s half of the factors: every trainable
    factor of the conv sits on the input side and all ``2L`` sketches ``U_i`` are fixed.
    """
    size = sketch_size(fan_in, fan_out, num_terms, low_rank, bias)
    return SketchSize(trainable=2 * num_terms * low_rank * fan_in + (fan_out if bias else 0), stored=size.stored)


class SKConv2d(nn.Module):
    r"""Sketched 2-D convolution: kernel ``K = 1/(2L) · Σ_i U_iᵀ S_i`` over ``2L`` terms.

    With ``L = num_terms`` and ``k = low_rank``, term ``i`` has a fixed output-side sketch
    ``U_i`` (k × C_out) and a trainable kernel ``S_i`` (k × C_in × kh × kw). The terms are
    stored concatenated — ``S`` (2Lk, C_in, kh, kw) as a parameter, ``U`` (2Lk, C_out) as a
    buffer — so the forward is one ``conv2d`` to ``2Lk`` channels followed by a 1×1
    convolution (a GEMM over channels) that mixes them back to ``C_out``:

        y = conv1x1(conv2d(x, S), Uᵀ / (2L)) + b  ==  conv2d(x, effective_weight()) + b

    Args:
        in_channels, out_channels: ``C_in`` and ``C_out``.
        kernel_size, stride, dilation: int or pair, as in ``nn.Conv2d``.
        padding: int, pair, ``"valid"`` or ``"same"`` (stride 1 only; even kernels are
            padded asymmetrically exactly like ``F.conv2d(padding="same")``).
        groups: only 1 is supported (ValueError otherwise).
        bias: learn an additive bias.
        num_terms: ``L``; the layer has ``2L`` terms.
        low_rank: ``k``, the rank of each term.
        layer: optional ``nn.Conv2d`` (same channels and kernel size, ``groups=1``) whose
            weight and bias the layer starts from (the anchor's argument); it supplies
            weights only (its bias must exist exactly when ``bias=True``);
            stride/padding/dilation are this layer's own arguments.
            Default: a kernel drawn with ``nn.Conv2d``'s init.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``.
        init: ``"sketch"`` — random ±1/√k sign sketches ``U_i`` and ``S_i = U_i K_mat``
            (the anchor's math, an unbiased estimate of the kernel); ``"svd"`` — the best
            rank-``2Lk`` fit of the ``C_out × (C_in·kh·kw)`` unfolding ``K_mat``.
        seed: makes the random sketches reproducible (drawn on the CPU).

    Shape:
        - Input: ``(N, C_in, H, W)`` or unbatched ``(C_in, H, W)``; channels_last inputs
          give channels_last outputs (except with ``padding_mode="circular"``, whose
          ``F.pad`` returns a contiguous tensor, as for ``nn.Conv2d``).
        - Output: ``(N, C_out, H_out, W_out)`` or ``(C_out, H_out, W_out)``, sizes as in
          ``nn.Conv2d``.

    Parameter counts (:meth:`parameter_counts`): trainable ``2Lk·C_in·kh·kw + C_out``
    (only ``S`` and the bias train); stored, with the ``U`` buffer,
    ``2Lk·(C_in·kh·kw + C_out) + C_out``.
    """

    __constants__ = [
        "in_channels",
        "out_channels",
        "kernel_size",
        "stride",
        "padding",
        "dilation",
        "padding_mode",
        "num_terms",
        "low_rank",
    ]

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: _IntOrPair = 3,
        stride: _IntOrPair = 1,
        padding: Union[str, _IntOrPair] = 1,
        dilation: _IntOrPair = 1,
        groups: int = 1,
        bias: bool = True,
        num_terms: int = 6,
        low_rank: int = 8,
        layer: Optional[nn.Conv2d] = None,
        dtype: Optional[torch.dtype] = None,
        device=None,
        *,
        padding_mode: str = "zeros",
        init: str = "sketch",
        seed: Optional[int] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if groups != 1:
            raise ValueError(f"SKConv2d supports only groups=1, got groups={groups!r}")
        check_sketch_args(num_terms, low_rank, init)
        self.kernel_size = _positive_pair("kernel_size", kernel_size)
        self.stride = _positive_pair("stride", stride)
        self.dilation = _positive_pair("dilation", dilation)
        self.padding = _padding_arg(padding)
        if self.padding == "same" and self.stride != (1, 1):
            raise ValueError("padding='same' is not supported for strided convolutions")
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
        if layer is not None:
            self._check_layer(layer, in_channels, out_channels, bias)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.groups = 1
        self.padding_mode = padding_mode
        self._reversed_padding_repeated_twice = _reversed_padding(self.padding, self.kernel_size, self.dilation)
        self.num_terms = num_terms
        self.low_rank = low_rank
        self.init = init
        self.seed = check_seed(seed)
        fan_in = in_channels * self.kernel_size[0] * self.kernel_size[1]
        warn_if_larger_than_dense(
            f"SKConv2d({in_channels}, {out_channels}, kernel_size={self.kernel_size}, "
            f"num_terms={num_terms}, low_rank={low_rank})",
            conv_sketch_size(fan_in, out_channels, num_terms, low_rank, bias),
            dense_size(fan_in, out_channels, bias),
        )
        rank = 2 * num_terms * low_rank
        self.S = nn.Parameter(torch.empty(rank, in_channels, *self.kernel_size, **factory_kwargs))
        self.register_buffer("U", torch.empty(rank, out_channels, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        if layer is None:
            self.reset_parameters()
        else:
            self._fit(layer.weight, init, None, resolve_generator(seed))
            if self.bias is not None:
                with torch.no_grad():
                    self.bias.copy_(layer.bias)

    def _check_layer(self, layer: nn.Conv2d, in_channels: int, out_channels: int, bias: bool) -> None:
        if not isinstance(layer, nn.Conv2d):
            raise TypeError(f"layer must be an nn.Conv2d or None, got {type(layer).__name__}")
        if layer.groups != 1:
            raise ValueError(f"SKConv2d supports only groups=1, got a layer with groups={layer.groups}")
        expected = (out_channels, in_channels, *self.kernel_size)
        if tuple(layer.weight.shape) != expected:
            raise ValueError(
                f"layer.weight must have shape (out_channels, in_channels, kh, kw) = {expected}, "
                f"got {tuple(layer.weight.shape)}"
            )
        if (layer.bias is not None) != bias:
            raise ValueError(f"bias={bias} but the layer {'has' if layer.bias is not None else 'has no'} bias")

    @property
    def scale(self) -> float:
        """``1 / (2L)``."""
        return 0.5 / self.num_terms

    @property
    def fan_in(self) -> int:
        """``C_in·kh·kw``, the width of the kernel's unfolding."""
        return self.in_channels * self.kernel_size[0] * self.kernel_size[1]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw a dense kernel and bias with ``nn.Conv2d``'s init (U(±1/√fan_in)), from
        ``seed`` when set; represent the kernel with ``self.init``; then rescale ``S`` so the
        effective kernel has the dense init's scale (see :mod:`panther_lite.nn.default_init`)."""
        if self.S.is_meta:
            return
        generator = resolve_generator(self.seed)
        weight = draw_dense_default((self.out_channels, self.in_channels, *self.kernel_size), self.fan_in, generator)
        self._fit(weight, self.init, None, generator)
        fill_bias_default_(self.bias, self.fan_in, generator)
        rescale_to_default_(self.effective_weight(), self.fan_in, (self.S,))

    @torch.no_grad()
    def initialize_from_weight(self, weight: Tensor, init: str = "svd", gram: Optional[Tensor] = None) -> None:
        """Set ``S`` and ``U`` to represent the dense kernel ``weight``; the bias is kept.

        Args:
            weight: ``(C_out, C_in, kh, kw)``, the ``nn.Conv2d`` layout; its unfolding
                ``K_mat`` is ``weight.reshape(C_out, C_in·kh·kw)``.
            init: ``"svd"`` — ``U = Qᵀ`` with ``Q`` the top ``2Lk`` left singular vectors
                of ``K_mat`` and ``S = 2L·U K_mat`` (the best rank-``2Lk`` fit);
                ``"sketch"`` — random ±1/√k signs ``U`` and ``S = U K_mat``.
            gram: with ``"svd"``, optional ``(C_in·kh·kw)²`` Gram ``XᵀX`` of unfolded input
                patches (``F.unfold`` order): the fit then minimises the output error.
        """
        check_sketch_args(self.num_terms, self.low_rank, init)
        expected = (self.out_channels, self.in_channels, *self.kernel_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight must have shape (C_out, C_in, kh, kw) = {expected}, got {tuple(weight.shape)}")
        check_gram(gram, init, self.fan_in, "C_in·kh·kw")
        self._fit(weight, init, gram, resolve_generator(self.seed))

    @torch.no_grad()
    def _fit(self, weight: Tensor, init: str, gram: Optional[Tensor], generator: Optional[torch.Generator]) -> None:
        work_dtype = decomposition_dtype(weight)
        kernel = weight.detach().to(device=self.S.device, dtype=work_dtype).reshape(self.out_channels, self.fan_in)
        rank = 2 * self.num_terms * self.low_rank
        if init == "svd":
            g = None if gram is None else gram.detach().to(device=kernel.device, dtype=work_dtype)
            U = output_subspace(kernel, rank, g).t()
            S = (2 * self.num_terms) * (U @ kernel)
        else:
            # sign_matrix scales by 1/sqrt(rows) = 1/sqrt(2Lk); each term wants 1/sqrt(k).
            U = sign_matrix(rank, self.out_channels, generator=generator, dtype=work_dtype, device=kernel.device)
            U = U * math.sqrt(2 * self.num_terms)
            S = U @ kernel
        self.U.copy_(U)
        self.S.copy_(S.view_as(self.S))
        self.init = init

    def _mix_weight(self) -> Tensor:
        """``Uᵀ / (2L)`` as a 1×1 kernel ``(C_out, 2Lk, 1, 1)`` in ``S``'s dtype (the fixed
        sketch follows the parameters under parameter-only casts such as FSDP2's)."""
        return (self.U.t().to(self.S.dtype) * self.scale).contiguous()[:, :, None, None]

    def forward(self, input: Tensor) -> Tensor:
        if input.dim() not in (3, 4) or input.shape[-3] != self.in_channels:
            raise ValueError(
                f"SKConv2d expected (N, C_in, H, W) or (C_in, H, W) input with C_in={self.in_channels}, "
                f"got shape {tuple(input.shape)}"
            )
        if self.padding_mode == "zeros":
            hidden = F.conv2d(input, self.S, None, self.stride, self.padding, self.dilation)
        else:
            padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            hidden = F.conv2d(padded, self.S, None, self.stride, 0, self.dilation)
        return F.conv2d(hidden, self._mix_weight(), self.bias)

    def effective_weight(self) -> Tensor:
        """The dense kernel ``(C_out, C_in, kh, kw)`` this layer applies:
        ``forward(x) == conv2d(x, W, b)`` with the layer's padding. Differentiable in ``S``."""
        return (self.scale * (self.U.t().to(self.S.dtype) @ self.S.flatten(1))).view(
            self.out_channels, self.in_channels, *self.kernel_size
        )

    def to_dense(self) -> nn.Conv2d:
        """An ``nn.Conv2d`` (same dtype, device and options) computing the same function."""
        dense = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
            device=self.S.device,
            dtype=self.S.dtype,
        )
        with torch.no_grad():
            dense.weight.copy_(self.effective_weight())
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    @classmethod
    def from_conv2d(
        cls,
        conv: nn.Conv2d,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        gram: Optional[Tensor] = None,
    ) -> "SKConv2d":
        """Build an SKConv2d (same options, device and dtype) approximating ``conv``.

        ``init="svd"`` (default) gives the best rank-``2Lk`` fit of its kernel, or with
        ``gram`` (``(C_in·kh·kw)²`` Gram of its unfolded input patches) the best fit of
        its outputs.
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"from_conv2d expects an nn.Conv2d, got {type(conv).__name__}")
        check_gram(gram, init, conv.weight[0].numel(), "C_in·kh·kw")
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            bias=conv.bias is not None,
            num_terms=num_terms,
            low_rank=low_rank,
            layer=conv,
            dtype=conv.weight.dtype,
            device=conv.weight.device,
            padding_mode=conv.padding_mode,
            # with a gram the kernel is fitted below; a sketch (GEMMs only) is the cheap placeholder
            init=init if gram is None else "sketch",
            seed=seed,
        )
        if gram is not None:
            layer.initialize_from_weight(conv.weight, init=init, gram=gram)
        return layer

    @classmethod
    def fromTorch(cls, layer: nn.Conv2d, num_terms: int, low_rank: int) -> "SKConv2d":
        """The anchor's name for :meth:`from_conv2d` (with its ``init="sketch"`` math)."""
        return cls.from_conv2d(layer, num_terms, low_rank, init="sketch")

    def parameter_counts(self) -> SketchSize:
        """Trainable (``S`` + bias) and stored (plus the ``U`` buffer) parameter counts
        (see :func:`conv_sketch_size`)."""
        return conv_sketch_size(self.fan_in, self.out_channels, self.num_terms, self.low_rank, self.bias is not None)

    @property
    def Ss(self) -> Tensor:
        """Per-term view ``(2L, k, C_in, kh, kw)`` of ``S``."""
        return self.S.view(2 * self.num_terms, self.low_rank, self.in_channels, *self.kernel_size)

    @property
    def Us(self) -> Tensor:
        """Per-term view ``(2L, k, C_out)`` of ``U``."""
        return self.U.view(2 * self.num_terms, self.low_rank, self.out_channels)

    def extra_repr(self) -> str:
        text = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding!r}, dilation={self.dilation}"
        )
        if self.padding_mode != "zeros":
            text += f", padding_mode={self.padding_mode!r}"
        return text + f", bias={self.bias is not None}, num_terms={self.num_terms}, low_rank={self.low_rank}"
