"""SKLinear: a drop-in replacement for ``nn.Linear`` built from sums of low-rank terms."""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..sketch.dense import sign_matrix
from ..sketch.random import check_seed, resolve_generator
from .functional import sketched_linear
from .low_rank_fit import decomposition_dtype, sketch_factors_from_weight
from .default_init import draw_dense_default, fill_bias_default_, rescale_to_default_
from .rank_selection import SketchSize, dense_size, sketch_size

__all__ = ["SKLinear"]

INITS = ("sketch", "svd")


def check_sketch_args(num_terms: int, low_rank: int, init: str) -> None:
    """Validate the arguments shared by both sketched layers (raises ValueError)."""
    for name, value in (("num_terms", num_terms), ("low_rank", low_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")


def check_gram(gram: Optional[Tensor], init: str, fan_in: int, fan_in_name: str) -> None:
    """Validate an optional calibration Gram ``(fan_in, fan_in)`` (raises ValueError)."""
    if gram is None:
        return
    if init != "svd":
        raise ValueError("a calibration gram is only used by init='svd'")
    if tuple(gram.shape) != (fan_in, fan_in):
        raise ValueError(
            f"gram must have shape ({fan_in_name}, {fan_in_name}) = ({fan_in}, {fan_in}), got {tuple(gram.shape)}"
        )


def warn_if_larger_than_dense(layer_name: str, size: SketchSize, dense: int) -> None:
    """Warn when a configuration stores more than the dense layer it replaces."""
    if size.stored > dense:
        warnings.warn(
            f"{layer_name} stores {size.stored:,} parameters (U buffers included), "
            f"{size.stored - dense:,} more than the dense layer's {dense:,} "
            f"({size.stored / dense:.2f}x); lower num_terms * low_rank to save memory",
            UserWarning,
            stacklevel=3,
        )


class SKLinear(nn.Module):
    r"""Sketched linear layer: ``y = 1/(2L) · Σ_i (x S1_i U1_i + x U2_i S2_i) + b``.

    With ``L = num_terms`` and ``k = low_rank``, term ``i`` has trainable ``S1_i``
    (in × k) and ``S2_i`` (k × out) and fixed sketch buffers ``U1_i`` (k × out) and
    ``U2_i`` (in × k). They are stored concatenated over terms — ``S1`` (in × Lk),
    ``U1`` (Lk × out), ``U2`` (in × Lk), ``S2`` (Lk × out) — so the forward is one
    rank-``2Lk`` product computed as GEMMs of width ``Lk`` into a single output (see
    :func:`panther_lite.nn.functional.sketched_linear`).

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        num_terms: ``L``, the number of sketch terms.
        low_rank: ``k``, the rank of each term.
        W_init: optional dense weight ``(out_features, in_features)`` (``nn.Linear``
            layout) to start from; default: ``nn.Linear``'s Kaiming-uniform init.
        bias: learn an additive bias.
        init: ``"sketch"`` — random ±1/√k sign sketches ``U`` and ``S1 = Wᵀ U1ᵀ``,
            ``S2 = U2ᵀ Wᵀ`` (the Panther/anchor math, an unbiased estimate of ``W``);
            ``"svd"`` — the exact best rank-``2Lk`` approximation of ``W``.
        seed: makes the random sketches reproducible (drawn on the CPU).

    Shape:
        - Input: ``(*, in_features)``, including 1-D ``(in_features,)``.
        - Output: ``(*, out_features)``.

    Parameter counts: trainable ``L·k·(in+out) + out``; stored, with the U buffers,
    ``2·L·k·(in+out) + out`` (:meth:`parameter_counts`).
    """

    __constants__ = ["in_features", "out_features", "num_terms", "low_rank"]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_terms: int,
        low_rank: int,
        W_init: Optional[Tensor] = None,
        bias: bool = True,
        dtype: Optional[torch.dtype] = None,
        device=None,
        *,
        init: str = "sketch",
        seed: Optional[int] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_sketch_args(num_terms, low_rank, init)
        if W_init is not None and not isinstance(W_init, Tensor):
            raise TypeError(f"W_init must be a Tensor or None, got {type(W_init).__name__}")
        if W_init is not None and tuple(W_init.shape) != (out_features, in_features):
            raise ValueError(
                f"W_init must have shape (out_features, in_features) = ({out_features}, {in_features}), "
                f"got {tuple(W_init.shape)}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.num_terms = num_terms
        self.low_rank = low_rank
        self.init = init
        self.seed = check_seed(seed)
        warn_if_larger_than_dense(
            f"SKLinear({in_features}, {out_features}, num_terms={num_terms}, low_rank={low_rank})",
            sketch_size(in_features, out_features, num_terms, low_rank, bias),
            dense_size(in_features, out_features, bias),
        )
        rank = num_terms * low_rank
        self.S1 = nn.Parameter(torch.empty(in_features, rank, **factory_kwargs))
        self.S2 = nn.Parameter(torch.empty(rank, out_features, **factory_kwargs))
        self.register_buffer("U1", torch.empty(rank, out_features, **factory_kwargs))
        self.register_buffer("U2", torch.empty(in_features, rank, **factory_kwargs))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)
        if W_init is None:
            self.reset_parameters()
        else:
            generator = resolve_generator(seed)
            self._fit(W_init, init, None, generator)
            fill_bias_default_(self.bias, in_features, generator)

    @property
    def scale(self) -> float:
        """``1 / (2L)``."""
        return 0.5 / self.num_terms

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw a dense weight and bias with ``nn.Linear``'s init (U(±1/√in_features)),
        from ``seed`` when set; represent the weight with ``self.init``; then rescale
        ``S1``, ``S2`` so the effective weight has the dense init's scale (see
        :mod:`panther_lite.nn.default_init`)."""
        if self.S1.is_meta:
            return
        generator = resolve_generator(self.seed)
        weight = draw_dense_default((self.out_features, self.in_features), self.in_features, generator)
        self._fit(weight, self.init, None, generator)
        fill_bias_default_(self.bias, self.in_features, generator)
        rescale_to_default_(self.effective_weight(), self.in_features, (self.S1, self.S2))

    @torch.no_grad()
    def initialize_from_weight(self, weight: Tensor, init: str = "svd", gram: Optional[Tensor] = None) -> None:
        """Set ``S1, U1, U2, S2`` to represent the dense ``weight`` (out × in).

        Args:
            weight: ``(out_features, in_features)``.
            init: ``"svd"`` (best rank-2Lk fit) or ``"sketch"`` (random sign sketches).
            gram: with ``"svd"``, optional ``(in, in)`` Gram ``XᵀX`` of calibration inputs:
                the fit then minimises the error of the outputs ``X Wᵀ`` instead.
        """
        check_sketch_args(self.num_terms, self.low_rank, init)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must have shape ({self.out_features}, {self.in_features}), got {tuple(weight.shape)}"
            )
        check_gram(gram, init, self.in_features, "in_features")
        self._fit(weight, init, gram, resolve_generator(self.seed))

    @torch.no_grad()
    def _fit(self, weight: Tensor, init: str, gram: Optional[Tensor], generator: Optional[torch.Generator]) -> None:
        work_dtype = decomposition_dtype(weight)
        w = weight.detach().to(device=self.S1.device, dtype=work_dtype)
        if init == "svd":
            g = None if gram is None else gram.detach().to(device=w.device, dtype=work_dtype)
            S1, U1, U2, S2 = sketch_factors_from_weight(w, self.num_terms, self.low_rank, g)
        else:
            rank = self.num_terms * self.low_rank
            kwargs = dict(generator=generator, dtype=work_dtype, device=w.device)
            # sign_matrix scales by 1/sqrt(rows) = 1/sqrt(L*k); each term wants 1/sqrt(k).
            to_per_term_scale = math.sqrt(self.num_terms)
            U1 = sign_matrix(rank, self.out_features, **kwargs) * to_per_term_scale
            U2 = sign_matrix(rank, self.in_features, **kwargs).t() * to_per_term_scale
            S1 = w.t() @ U1.t()
            S2 = U2.t() @ w.t()
        for target, value in ((self.S1, S1), (self.U1, U1), (self.U2, U2), (self.S2, S2)):
            target.copy_(value)
        self.init = init

    def forward(self, input: Tensor) -> Tensor:
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"SKLinear expected input with last dimension in_features={self.in_features}, "
                f"got shape {tuple(input.shape)}"
            )
        return sketched_linear(input, self.S1, self.U1, self.U2, self.S2, self.bias, self.scale)

    def effective_weight(self) -> Tensor:
        """The dense weight ``(out_features, in_features)`` this layer applies:
        ``forward(x) == x @ W.T + b``. Differentiable with respect to ``S1``, ``S2``."""
        dtype = self.S1.dtype
        return (self.scale * (self.S1 @ self.U1.to(dtype) + self.U2.to(dtype) @ self.S2)).t()

    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` (same dtype and device) computing the same function."""
        dense = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device=self.S1.device, dtype=self.S1.dtype
        )
        with torch.no_grad():
            dense.weight.copy_(self.effective_weight())
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        num_terms: int,
        low_rank: int,
        *,
        init: str = "svd",
        seed: Optional[int] = None,
        gram: Optional[Tensor] = None,
    ) -> "SKLinear":
        """Build an SKLinear (same device and dtype) approximating ``linear``.

        ``init="svd"`` (default) gives the best rank-``2Lk`` fit of its weight, or with
        ``gram`` (``XᵀX`` of calibration inputs) the best fit of its outputs.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        check_sketch_args(num_terms, low_rank, init)
        check_gram(gram, init, linear.in_features, "in_features")
        layer = cls(
            linear.in_features,
            linear.out_features,
            num_terms,
            low_rank,
            # with a gram the weight is fitted below; a sketch (GEMMs only) is the cheap placeholder
            W_init=linear.weight,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            init=init if gram is None else "sketch",
            seed=seed,
        )
        if gram is not None:
            layer.initialize_from_weight(linear.weight, init=init, gram=gram)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    def parameter_counts(self) -> SketchSize:
        """Trainable (S factors + bias) and stored (plus U buffers) parameter counts."""
        return sketch_size(self.in_features, self.out_features, self.num_terms, self.low_rank, self.bias is not None)

    @property
    def S1s(self) -> Tensor:
        """Per-term view ``(L, in, k)`` of ``S1`` (the anchor's layout)."""
        return self.S1.view(self.in_features, self.num_terms, self.low_rank).permute(1, 0, 2)

    @property
    def S2s(self) -> Tensor:
        """Per-term view ``(L, k, out)`` of ``S2``."""
        return self.S2.view(self.num_terms, self.low_rank, self.out_features)

    @property
    def U1s(self) -> Tensor:
        """Per-term view ``(L, k, out)`` of ``U1``."""
        return self.U1.view(self.num_terms, self.low_rank, self.out_features)

    @property
    def U2s(self) -> Tensor:
        """Per-term view ``(L, in, k)`` of ``U2``."""
        return self.U2.view(self.in_features, self.num_terms, self.low_rank).permute(1, 0, 2)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_terms={self.num_terms}, low_rank={self.low_rank}, bias={self.bias is not None}"
        )
