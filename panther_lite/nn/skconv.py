"""SKConv1d, SKConv2d, SKConv3d: sketched convolutions, one N-d implementation (kernel = sum of sketched terms)."""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..sketch.dense import sign_matrix
from .functional import autocast_enabled_on
from .layer_base import SketchedLayer
from .low_rank_fit import metric_basis, metric_times, output_metric_roots, output_subspace
from .rank_selection import SketchSize, sketch_size
from .validation import check_choice, check_int_tuple, check_positive_int, check_sketch_fits_a_tensor, check_tensor

__all__ = ["SKConv1d", "SKConv2d", "SKConv3d", "conv_sketch_size"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
PADDING_STRINGS = ("same", "valid")
_KERNEL_NAMES = {1: ("k",), 2: ("kh", "kw"), 3: ("kd", "kh", "kw")}
_SPATIAL_NAMES = {1: "L", 2: "H, W", 3: "D, H, W"}

_IntOrTuple = Union[int, Tuple[int, ...]]


def _padding_arg(padding: Union[str, _IntOrTuple], dims: int) -> Union[str, Tuple[int, ...]]:
    """``padding`` as ``"same"``/``"valid"`` or a tuple of ``dims`` non-negative ints."""
    if isinstance(padding, str):
        return check_choice("padding", padding, PADDING_STRINGS)
    try:
        return check_int_tuple("padding", padding, dims, minimum=0)
    except ValueError:
        raise ValueError(
            f"padding must be a non-negative int, a tuple of {dims} of them or one of {PADDING_STRINGS}, "
            f"got {padding!r}"
        ) from None


def _reversed_padding(
    padding: Union[str, Tuple[int, ...]], kernel_size: Tuple[int, ...], dilation: Tuple[int, ...]
) -> Tuple[int, ...]:
    """Padding for ``F.pad`` (last dimension first, before/after pairs), as ``nn.Conv*d``
    computes it: ``"same"`` puts ``total // 2`` before and the rest after (asymmetric for
    even kernels), exactly like ``F.conv*d(padding="same")``."""
    if padding == "valid":
        return (0, 0) * len(kernel_size)
    if padding == "same":
        pads = []
        for d, k in zip(reversed(dilation), reversed(kernel_size)):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    return tuple(p for p in reversed(padding) for _ in range(2))


def _autocast_casts(input: Tensor) -> bool:
    """Whether autocast will cast ``input`` (it is on for the input's device and leaves float64
    alone); False on devices autocast does not know, such as meta."""
    return input.dtype != torch.float64 and autocast_enabled_on(input.device.type)


def conv_sketch_size(fan_in: int, fan_out: int, num_terms: int, low_rank: int, bias: bool = True) -> SketchSize:
    """Parameter counts of a sketched convolution with ``fan_in = C_in·prod(kernel_size)``
    and ``fan_out = C_out``.

    ``stored`` (``2Lk·(fan_in + fan_out)`` + bias) is :func:`sketch_size`'s. ``trainable``
    is ``2Lk·fan_in`` + bias, not ``sketch_size``'s half of the factors: every trainable
    factor of the conv sits on the input side and all ``2L`` sketches ``U_i`` are fixed.
    """
    size = sketch_size(fan_in, fan_out, num_terms, low_rank, bias)
    return SketchSize(trainable=2 * num_terms * low_rank * fan_in + (fan_out if bias else 0), stored=size.stored)


class _SKConvNd(SketchedLayer):
    r"""Sketched N-d convolution: kernel ``K = 1/(2L) · Σ_i U_iᵀ S_i`` over ``2L`` terms.

    Term ``i`` has a fixed output-side sketch ``U_i`` (k × C_out) and a trainable kernel
    ``S_i`` (k × C_in × *kernel_size), stored concatenated: ``S`` (2Lk, C_in, *kernel_size)
    as a parameter, ``U`` (2Lk, C_out) as a buffer. The forward is one convolution to
    ``2Lk`` channels followed by a 1×…×1 convolution (a GEMM over channels) mixing them
    back to ``C_out``: ``y = conv(conv(x, S), Uᵀ / (2L)) + b == conv(x, effective_weight()) + b``.

    A subclass sets ``_dims``, ``_conv`` (``F.conv1d``/``2d``/``3d``) and ``_dense_class``.
    """

    _dims: int = 0
    _conv: Callable[..., Tensor]
    _factor_names = ("S", "U")
    _trainable_names = ("S",)

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
        kernel_size: _IntOrTuple,
        stride: _IntOrTuple = 1,
        padding: Union[str, _IntOrTuple] = 0,
        dilation: _IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype: Optional[torch.dtype] = None,
        *,
        num_terms: int = 6,
        low_rank: int = 8,
        layer: Optional[nn.Module] = None,
        init: str = "sketch",
        seed: Optional[int] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_terms, low_rank, init, seed)
        dims = self._dims
        self.in_channels = check_positive_int("in_channels", in_channels)
        self.out_channels = check_positive_int("out_channels", out_channels)
        if groups != 1:
            raise ValueError(f"{type(self).__name__} supports only groups=1, got groups={groups!r}")
        self.groups = 1
        self.kernel_size = check_int_tuple("kernel_size", kernel_size, dims)
        self.stride = check_int_tuple("stride", stride, dims)
        self.dilation = check_int_tuple("dilation", dilation, dims)
        self.padding = _padding_arg(padding, dims)
        if self.padding == "same" and self.stride != (1,) * dims:
            raise ValueError("padding='same' is not supported for strided convolutions")
        self.padding_mode = check_choice("padding_mode", padding_mode, PADDING_MODES)
        self._reversed_padding_repeated_twice = _reversed_padding(self.padding, self.kernel_size, self.dilation)
        if layer is not None:
            self._check_layer(layer, bias)
        fan_in = in_channels * math.prod(self.kernel_size)
        check_sketch_fits_a_tensor(self.num_terms, self.low_rank, fan_in, out_channels)
        rank = 2 * self.num_terms * self.low_rank
        self.S = nn.Parameter(torch.empty(rank, in_channels, *self.kernel_size, **factory_kwargs))
        self.register_buffer("U", torch.empty(rank, out_channels, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        self._initialize("layer.weight", None if layer is None else layer.weight, None if layer is None else layer.bias)

    def _check_layer(self, layer: nn.Module, bias: bool) -> None:
        dense_name = f"nn.{self._dense_class.__name__}"
        if not isinstance(layer, self._dense_class):
            raise TypeError(f"layer must be an {dense_name} or None, got {type(layer).__name__}")
        if layer.groups != 1:
            raise ValueError(f"{type(self).__name__} supports only groups=1, got a layer with groups={layer.groups}")
        self._check_dense_weight("layer.weight", layer.weight, values=False)
        if (layer.bias is not None) != bias:
            raise ValueError(f"bias={bias} but the layer {'has' if layer.bias is not None else 'has no'} bias")

    @property
    def _weight_layout(self) -> str:
        return f"(out_channels, in_channels, {', '.join(_KERNEL_NAMES[self._dims])})"

    @property
    def _fan_in_name(self) -> str:
        return "·".join(("C_in",) + _KERNEL_NAMES[self._dims])

    @property
    def fan_in(self) -> int:
        """``C_in·prod(kernel_size)``, the width of the kernel's unfolding."""
        return self.in_channels * math.prod(self.kernel_size)

    @property
    def fan_out(self) -> int:
        """``C_out``."""
        return self.out_channels

    @property
    def dense_weight_shape(self) -> Tuple[int, ...]:
        """``(C_out, C_in, *kernel_size)``, the ``nn.Conv*d`` layout."""
        return (self.out_channels, self.in_channels, *self.kernel_size)

    def _svd_factors(self, matrix: Tensor, gram: Optional[Tensor], fit: str, output_gram: Optional[Tensor] = None):
        # K ≈ R⁻¹Q QᵀR K = P·T QᵀR K (R⁻¹Q = P T, P orthonormal; R = I without a metric). U = 2L·Pᵀ carries the 2L
        # the 1/(2L) scale undoes (S = T QᵀR K at the output's scale), and a step on S reaches K unamplified by R⁻¹.
        rank = 2 * self.num_terms * self.low_rank
        root, inverse = (None, None) if output_gram is None else output_metric_roots(output_gram, matrix.shape[0])
        target = metric_times(root, matrix)
        basis = output_subspace(target, rank, gram, method=fit, seed=self.seed)
        output_basis, triangle = metric_basis(inverse, basis)
        return (basis.t() if triangle is None else triangle @ basis.t()) @ target, (2 * self.num_terms) * output_basis.t()

    def _sketch_factors(self, matrix: Tensor, generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
        rank = 2 * self.num_terms * self.low_rank
        U = sign_matrix(rank, self.out_channels, generator=generator, dtype=matrix.dtype, device=matrix.device)
        # sign_matrix scales by 1/sqrt(rows) = 1/sqrt(2Lk); each term wants 1/sqrt(k).
        U = U * math.sqrt(2 * self.num_terms)
        return U @ matrix, U

    def _mix_matrix(self) -> Tensor:
        """``Uᵀ / (2L)`` ``(C_out, 2Lk)`` in ``S``'s dtype (the fixed sketch follows the
        parameters under parameter-only casts such as FSDP2's)."""
        return (self.U * self.scale).to(self.S.dtype).t().contiguous()

    def _check_input(self, input: Tensor) -> None:
        dims = self._dims
        shape_ok = isinstance(input, Tensor) and input.dim() in (dims + 1, dims + 2)
        if not shape_ok or input.shape[-dims - 1] != self.in_channels:
            check_tensor("input", input)
            spatial = _SPATIAL_NAMES[dims]
            raise ValueError(
                f"{type(self).__name__} expected (N, C_in, {spatial}) or (C_in, {spatial}) input with "
                f"C_in={self.in_channels}, got shape {tuple(input.shape)}"
            )
        if input.dtype != self.S.dtype and not _autocast_casts(input):
            raise TypeError(
                f"{type(self).__name__}: S has dtype {self.S.dtype} but the input has {input.dtype}; "
                "cast one of them (autocast leaves float64 alone)"
            )

    def _forward(self, input: Tensor) -> Tensor:
        """The forward of every dimension (each subclass's ``forward`` is its own code object,
        so ``torch.compile`` does not treat a 1-d and a 3-d call as one function whose input
        shapes changed, which would recompile it with dynamic shapes)."""
        self._check_input(input)
        self._drop_weight_cache()
        if self.padding_mode == "zeros":
            hidden = self._conv(input, self.S, None, self.stride, self.padding, self.dilation)
        else:
            padded = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            hidden = self._conv(padded, self.S, None, self.stride, 0, self.dilation)
        mix = self._mix_matrix()
        if hidden.dim() == self._dims + 2 and hidden.stride(1) == 1:
            # Channels-last (channels_last, channels_last_3d, a transposed 1-d input): the mix
            # as a GEMM over the channel dimension keeps that layout, which a 1×1×1 conv3d on
            # CPU does not, and measured 1.4-3.5× faster than the 1×…×1 conv on CPU.
            return F.linear(hidden.movedim(1, -1), mix, self.bias).movedim(-1, 1)
        return self._conv(hidden, mix.view(self.out_channels, -1, *(1,) * self._dims), self.bias)

    def effective_weight(self) -> Tensor:
        """The dense kernel ``(C_out, C_in, *kernel_size)`` this layer applies:
        ``forward(x) == conv(x, W, b)`` with the layer's padding. Differentiable in ``S``."""
        return (self._mix_matrix() @ self.S.flatten(1)).view(self.dense_weight_shape)

    def _dense_options(self) -> Dict[str, object]:
        return dict(
            in_channels=self.in_channels,
            out_channels=self.out_channels,
            kernel_size=self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
        )

    @classmethod
    def _options_from_dense(cls, dense: nn.Module) -> Dict[str, object]:
        return dict(
            in_channels=dense.in_channels,
            out_channels=dense.out_channels,
            kernel_size=dense.kernel_size,
            stride=dense.stride,
            padding=dense.padding,
            dilation=dense.dilation,
            groups=dense.groups,
            bias=dense.bias is not None,
            padding_mode=dense.padding_mode,
        )

    def parameter_counts(self) -> SketchSize:
        """Trainable (``S`` + bias) and stored (plus the ``U`` buffer) parameter counts
        (see :func:`conv_sketch_size`)."""
        return conv_sketch_size(self.fan_in, self.out_channels, self.num_terms, self.low_rank, self.bias is not None)

    @property
    def Ss(self) -> Tensor:
        """Per-term view ``(2L, k, C_in, *kernel_size)`` of ``S``."""
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


def _named_from_dense(dense_class: type, fan_in_name: str) -> classmethod:
    """``from_conv1d``/``2d``/``3d``: :meth:`~panther_lite.nn.layer_base.SketchedLayer.from_dense`
    under the name users look for."""
    name = dense_class.__name__

    def from_conv(
        cls,
        conv: nn.Module,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        gram: Optional[Tensor] = None,
        fit: str = "auto",
    ) -> _SKConvNd:
        return cls.from_dense(conv, num_terms, low_rank, init=init, seed=seed, gram=gram, fit=fit)

    from_conv.__name__ = from_conv.__qualname__ = f"from_{name.lower()}"
    from_conv.__doc__ = f"""Build a sketched layer (same options, device and dtype) approximating the
        ``nn.{name}`` ``conv``.

        ``init="svd"`` (default) gives the best rank-``2Lk`` fit of its kernel, or with
        ``gram`` (``({fan_in_name})²`` Gram of its input patches, in ``weight.reshape(C_out, -1)``
        order, i.e. ``F.unfold``'s for 2-d) the best fit of its outputs; ``fit`` picks the
        decomposition (``"auto"``, ``"exact"``, ``"randomized"``).
        """
    return classmethod(from_conv)


_SHARED_DOC = """
    The arguments up to ``dtype`` are ``nn.Conv{d}d``'s, in its order and with its defaults
    (``kernel_size`` required, ``stride=1``, ``padding=0``, ...), so swapping one class for
    the other keeps every call and every output shape; the sketch's own arguments are
    keyword-only.

    Args:
        in_channels, out_channels: ``C_in`` and ``C_out``.
        kernel_size, stride, dilation: int or tuple, as in ``nn.Conv{d}d``.
        padding: int, tuple, ``"valid"`` or ``"same"`` (stride 1 only; even kernels are
            padded asymmetrically exactly like ``F.conv{d}d(padding="same")``). Default 0.
        groups: only 1 is supported (ValueError otherwise).
        bias: learn an additive bias.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``.
        device, dtype: where and in which dtype the factors are created.
        num_terms: ``L``; the layer has ``2L`` terms (keyword-only).
        low_rank: ``k``, the rank of each term (keyword-only).
        layer: optional ``nn.Conv{d}d`` (same channels and kernel size, ``groups=1``) whose
            weight and bias the layer starts from (the anchor's argument, keyword-only); it
            supplies weights only (its bias must exist exactly when ``bias=True``);
            stride/padding/dilation are this layer's own arguments.
            Default: a kernel drawn with ``nn.Conv{d}d``'s init.
        init: ``"sketch"`` — random ±1/√k sign sketches ``U_i`` and ``S_i = U_i K_mat``
            (the anchor's math, an unbiased estimate of the kernel; its intermediate
            ``conv(x, S)`` is about ``√(C_out/k)`` times the output, which can overflow in
            float16 where the dense layer does not); ``"svd"`` — the best
            rank-``2Lk`` fit of the ``C_out × fan_in`` unfolding ``K_mat`` (``U = 2L·Qᵀ``,
            ``S = Qᵀ K_mat`` with ``Q`` its top ``2Lk`` left singular vectors).
        seed: makes the random sketches reproducible (drawn on the CPU).

    Parameter counts (:meth:`parameter_counts`): trainable ``2Lk·fan_in + C_out`` (only
    ``S`` and the bias train) with ``fan_in = C_in·prod(kernel_size)``; stored, with the
    ``U`` buffer, ``2Lk·(fan_in + C_out) + C_out``. ``weight`` is the effective kernel,
    read-only.
"""


class SKConv1d(_SKConvNd):
    __doc__ = (
        r"""Sketched 1-D convolution, a drop-in replacement for ``nn.Conv1d`` (``groups=1``).

    Computes ``conv1d(conv1d(x, S), Uᵀ / (2L)) + b``; see :class:`SKConv2d` for the math.

    Shape:
        - Input: ``(N, C_in, L_in)`` or unbatched ``(C_in, L_in)``.
        - Output: ``(N, C_out, L_out)`` or ``(C_out, L_out)``, sizes as in ``nn.Conv1d``.
"""
        + _SHARED_DOC.format(d=1)
    )

    _dims = 1
    _conv = staticmethod(F.conv1d)
    _dense_class = nn.Conv1d

    def forward(self, input: Tensor) -> Tensor:
        return self._forward(input)

    from_conv1d = _named_from_dense(nn.Conv1d, "C_in·k")


class SKConv2d(_SKConvNd):
    __doc__ = (
        r"""Sketched 2-D convolution: kernel ``K = 1/(2L) · Σ_i U_iᵀ S_i`` over ``2L`` terms.

    With ``L = num_terms`` and ``k = low_rank``, term ``i`` has a fixed output-side sketch
    ``U_i`` (k × C_out) and a trainable kernel ``S_i`` (k × C_in × kh × kw). The terms are
    stored concatenated — ``S`` (2Lk, C_in, kh, kw) as a parameter, ``U`` (2Lk, C_out) as a
    buffer — so the forward is one ``conv2d`` to ``2Lk`` channels followed by a 1×1
    convolution (a GEMM over channels) that mixes them back to ``C_out``:

        y = conv1x1(conv2d(x, S), Uᵀ / (2L)) + b  ==  conv2d(x, effective_weight()) + b

    Shape:
        - Input: ``(N, C_in, H, W)`` or unbatched ``(C_in, H, W)``; channels_last inputs
          give channels_last outputs (except with ``padding_mode="circular"``, whose
          ``F.pad`` returns a contiguous tensor, as for ``nn.Conv2d``).
        - Output: ``(N, C_out, H_out, W_out)`` or ``(C_out, H_out, W_out)``, sizes as in
          ``nn.Conv2d``.
"""
        + _SHARED_DOC.format(d=2)
    )

    _dims = 2
    _conv = staticmethod(F.conv2d)
    _dense_class = nn.Conv2d

    def forward(self, input: Tensor) -> Tensor:
        return self._forward(input)

    from_conv2d = _named_from_dense(nn.Conv2d, "C_in·kh·kw")

    @classmethod
    def fromTorch(cls, layer: nn.Conv2d, num_terms: int, low_rank: int) -> "SKConv2d":
        """The anchor's name for :meth:`from_conv2d` (with its ``init="sketch"`` math)."""
        return cls.from_conv2d(layer, num_terms, low_rank, init="sketch")


class SKConv3d(_SKConvNd):
    __doc__ = (
        r"""Sketched 3-D convolution, a drop-in replacement for ``nn.Conv3d`` (``groups=1``).

    Computes ``conv3d(conv3d(x, S), Uᵀ / (2L)) + b``; see :class:`SKConv2d` for the math.

    Shape:
        - Input: ``(N, C_in, D, H, W)`` or unbatched ``(C_in, D, H, W)``;
          ``channels_last_3d`` inputs give ``channels_last_3d`` outputs (except with
          ``padding_mode="circular"``).
        - Output: ``(N, C_out, D_out, H_out, W_out)`` or unbatched, sizes as in ``nn.Conv3d``.
"""
        + _SHARED_DOC.format(d=3)
    )

    _dims = 3
    _conv = staticmethod(F.conv3d)
    _dense_class = nn.Conv3d

    def forward(self, input: Tensor) -> Tensor:
        return self._forward(input)

    from_conv3d = _named_from_dense(nn.Conv3d, "C_in·kd·kh·kw")
