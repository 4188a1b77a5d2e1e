"""SKLinear: a drop-in replacement for ``nn.Linear`` built from sums of low-rank terms."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .factor_cache import cached_factors
from .functional import cache_fits, eager_no_grad, packs, sketched_linear
from .linear_factors import LinearFactorsLayer
from .rank_selection import SketchSize, sketch_size
from .validation import check_tensor

__all__ = ["SKLinear"]


class SKLinear(LinearFactorsLayer):
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
        device, dtype: where and in which dtype the factors are created, as for ``nn.Linear``
            (same positions: ``bias``, ``device``, ``dtype`` after the sketch arguments).
        init: ``"sketch"`` — random ±1/√k sign sketches ``U`` and ``S1 = Wᵀ U1ᵀ``,
            ``S2 = U2ᵀ Wᵀ`` (the Panther/anchor math, an unbiased estimate of ``W``);
            its intermediate ``x·S1`` is a random projection of the output ``x·Wᵀ``, about
            ``√(out_features/k)`` times larger, so in float16 it can overflow where the dense
            layer does not (use ``"svd"``, bfloat16 or float32 there);
            ``"svd"`` — the exact best rank-``2Lk`` approximation of ``W``, whose
            intermediates are no larger than the output.
        seed: makes the random sketches reproducible (drawn on the CPU).

    Shape:
        - Input: ``(*, in_features)``, including 1-D ``(in_features,)``.
        - Output: ``(*, out_features)``.

    Parameter counts: trainable ``L·k·(in+out) + out``; stored, with the U buffers,
    ``2·L·k·(in+out) + out`` (:meth:`parameter_counts`). ``weight`` is the effective
    weight, read-only (see :attr:`SketchedLayer.weight <panther_lite.nn.layer_base.SketchedLayer.weight>`).
    """

    __constants__ = ["in_features", "out_features", "num_terms", "low_rank"]
    _dense_class = nn.Linear
    _weight_layout = "(out_features, in_features)"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_terms: int,
        low_rank: int,
        W_init: Optional[Tensor] = None,
        bias: bool = True,
        device=None,
        dtype: Optional[torch.dtype] = None,
        *,
        init: str = "sketch",
        seed: Optional[int] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_terms, low_rank, init, seed)
        self._register_factors((), in_features, out_features, bias, factory_kwargs, W_init)
        self._initialize("W_init", W_init, None)

    @property
    def dense_weight_shape(self) -> Tuple[int, int]:
        """``(out_features, in_features)``, the ``nn.Linear`` layout."""
        return (self.out_features, self.in_features)

    _derived_state = ("_weight_cache", "_cached_factors")

    def forward(self, input: Tensor) -> Tensor:
        state = self.__dict__
        entry = state.get("_cached_factors")
        # An eager no-grad call of a small layer spends as long in the general route's checks as in
        # its two products (bfloat16 on CPU, SmolLM2's layers at one row: 7-12 µs of 25-45 µs), so
        # the cache entry the layer keeps is tried first; it returns None where it no longer serves.
        if entry is not None and type(input) is Tensor and "_weight_cache" not in state and eager_no_grad():
            out = entry.product(input, *self._operands(), self.scale)
            if out is not None:
                return out
        if not isinstance(input, Tensor) or input.dim() == 0 or input.shape[-1] != self.in_features:
            check_tensor("input", input)
            raise ValueError(
                f"SKLinear expected input with last dimension in_features={self.in_features}, "
                f"got shape {tuple(input.shape)}"
            )
        self._drop_weight_cache()
        out = sketched_linear(input, *self._operands(), self.scale)
        self._keep_cached_factors(input)
        return out

    def _keep_cached_factors(self, input: Tensor) -> None:
        """After an eager no-grad call by the cached route, keep its cache entry for
        :meth:`forward` (a reference: the tensors are the cache's)."""
        if type(input) is not Tensor or not eager_no_grad():
            return
        self.__dict__.pop("_cached_factors", None)
        S1, U1, U2, S2, bias = self._operands()
        same_dtype = all(t.dtype == input.dtype for t in (S1, U1, U2, S2) + (() if bias is None else (bias,)))
        if same_dtype and cache_fits(S1, S2):
            entry = cached_factors(S1, U1, U2, S2, self.scale, packs(input, S1, bias))
            if entry is not None:
                self.__dict__["_cached_factors"] = entry

    def _operands(self) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(S1, U1, U2, S2, bias)``. Read from the registries directly: five
        ``Module.__getattr__`` calls cost more than the GEMMs of a small layer's eager call.
        Parametrized (or otherwise overridden) factors are not in the registries."""
        params, buffers = self._parameters, self._buffers
        try:
            return params["S1"], buffers["U1"], buffers["U2"], params["S2"], params["bias"]
        except KeyError:
            return self.S1, self.U1, self.U2, self.S2, self.bias

    def effective_weight(self) -> Tensor:
        """The dense weight ``(out_features, in_features)`` this layer applies:
        ``forward(x) == x @ W.T + b``. Differentiable with respect to ``S1``, ``S2``."""
        dtype = self.S1.dtype
        return (self.scale * (self.S1 @ self.U1.to(dtype) + self.U2.to(dtype) @ self.S2)).t()

    def _dense_options(self) -> Dict[str, object]:
        return dict(in_features=self.in_features, out_features=self.out_features, bias=self.bias is not None)

    @classmethod
    def _options_from_dense(cls, dense: nn.Linear) -> Dict[str, object]:
        return dict(in_features=dense.in_features, out_features=dense.out_features, bias=dense.bias is not None)

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
        fit: str = "auto",
    ) -> "SKLinear":
        """Build an SKLinear (same device and dtype) approximating ``linear``.

        ``init="svd"`` (default) gives the best rank-``2Lk`` fit of its weight, or with
        ``gram`` (``XᵀX`` of calibration inputs, ``(in_features, in_features)``) the best
        fit of its outputs; ``fit`` picks the decomposition (``"auto"``, ``"exact"``,
        ``"randomized"``). See :meth:`~panther_lite.nn.layer_base.SketchedLayer.from_dense`.
        """
        return cls.from_dense(linear, num_terms, low_rank, init=init, seed=seed, gram=gram, fit=fit)

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
