"""The factor layout and per-matrix fits that SKLinear and SKStackedLinear share."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..sketch.dense import sign_matrix
from .factor_layout import LEFT, RIGHT, contiguous_factors_hook, use_decode_layout, uses_decode_layout
from .layer_base import SketchedLayer
from .low_rank_fit import sketch_factors_from_weight
from .validation import check_positive_int, check_sketch_fits_a_tensor

__all__ = ["LinearFactorsLayer", "sign_sketch_factors"]


def sign_sketch_factors(
    weight: Tensor, num_terms: int, low_rank: int, generator: Optional[torch.Generator]
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(S1, U1, U2, S2)`` of the random-sketch (anchor) form of ``weight`` ``(out, in)``:
    sign sketches ``U1`` (Lk × out) and ``U2`` (in × Lk) with entries ``±1/√k``, ``S1 = Wᵀ U1ᵀ``
    and ``S2 = U2ᵀ Wᵀ`` (an unbiased estimate of ``W``), drawn from ``generator``."""
    rank = num_terms * low_rank
    out_features, in_features = weight.shape
    kwargs = dict(generator=generator, dtype=weight.dtype, device=weight.device)
    # sign_matrix scales by 1/sqrt(rows) = 1/sqrt(L*k); each term wants 1/sqrt(k).
    to_per_term_scale = math.sqrt(num_terms)
    U1 = sign_matrix(rank, out_features, **kwargs) * to_per_term_scale
    U2 = sign_matrix(rank, in_features, **kwargs).t() * to_per_term_scale
    return weight.t() @ U1.t(), U1, U2, U2.t() @ weight.t()


class LinearFactorsLayer(SketchedLayer):
    """A sketched layer storing SKLinear's factors, with optional leading (stack) dimensions:
    trainable ``S1`` ``(*, in, Lk)`` and ``S2`` ``(*, Lk, out)``, fixed sketch buffers ``U1``
    ``(*, Lk, out)`` and ``U2`` ``(*, in, Lk)``, and a bias ``(*, out)``. Each ``(out, in)``
    matrix is fitted by :func:`~panther_lite.nn.low_rank_fit.sketch_factors_from_weight`
    (``init="svd"``) or :func:`sign_sketch_factors` (``init="sketch"``).

    The factors are row-major unless :func:`~panther_lite.nn.factor_layout.use_decode_layout`
    re-laid them for fast decoding (kept after ``.to()``, with the dtype's rule); ``state_dict``
    gives them contiguous, so saved files do not depend on the layout."""

    _factor_names = ("S1", "U1", "U2", "S2")
    _factor_sides = {"S1": LEFT, "U1": RIGHT, "U2": LEFT, "S2": RIGHT}
    _trainable_names = ("S1", "S2")
    _fan_in_name = "in_features"

    def _register_factors(
        self,
        leading: Tuple[int, ...],
        in_features: int,
        out_features: int,
        bias: bool,
        factory_kwargs: dict,
        W_init: Optional[Tensor],
    ) -> None:
        """Validate the sizes and the shape of ``W_init`` (if given), then create the
        (uninitialised) factors and bias."""
        self.in_features = check_positive_int("in_features", in_features)
        self.out_features = check_positive_int("out_features", out_features)
        stack = math.prod(leading)
        check_sketch_fits_a_tensor(self.num_terms, self.low_rank, stack * in_features, stack * out_features)
        if W_init is not None:
            self._check_dense_weight("W_init", W_init, values=False)
        rank = self.num_terms * self.low_rank
        self.S1 = nn.Parameter(torch.empty(*leading, in_features, rank, **factory_kwargs))
        self.S2 = nn.Parameter(torch.empty(*leading, rank, out_features, **factory_kwargs))
        self.register_buffer("U1", torch.empty(*leading, rank, out_features, **factory_kwargs))
        self.register_buffer("U2", torch.empty(*leading, in_features, rank, **factory_kwargs))
        self.register_state_dict_post_hook(contiguous_factors_hook)
        if bias:
            self.bias = nn.Parameter(torch.empty(*leading, out_features, **factory_kwargs))
        else:
            self.register_parameter("bias", None)

    def _apply(self, fn, recurse: bool = True):
        """``Module._apply`` (``.to()``, ``.half()``, ...); a layer in the decode layout then
        applies the new dtype's rule to its right factors (in place; a no-op if unchanged)."""
        decode = uses_decode_layout(self)
        super()._apply(fn, recurse)
        if decode:
            use_decode_layout(self)
        return self

    @property
    def fan_in(self) -> int:
        """``in_features``."""
        return self.in_features

    @property
    def fan_out(self) -> int:
        """``out_features``."""
        return self.out_features

    def _svd_factors(
        self, matrix: Tensor, gram: Optional[Tensor], fit: str, output_gram: Optional[Tensor] = None
    ) -> Tuple[Tensor, ...]:
        return sketch_factors_from_weight(
            matrix, self.num_terms, self.low_rank, gram, output_gram=output_gram, method=fit, seed=self.seed
        )

    def _sketch_factors(self, matrix: Tensor, generator: Optional[torch.Generator]) -> Tuple[Tensor, ...]:
        return sign_sketch_factors(matrix, self.num_terms, self.low_rank, generator)
