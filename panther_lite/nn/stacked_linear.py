"""SKStackedLinear: a stack of sketched linear maps (one per expert), stored as stacked factors."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .factor_cache import stacked_factors
from .functional import cast_operands, check_operands
from .linear_factors import LinearFactorsLayer
from .rank_selection import SketchSize, dense_size, sketch_size
from .validation import check_gram, check_positive_int, check_tensor

__all__ = ["SKStackedLinear"]


class SKStackedLinear(LinearFactorsLayer):
    r"""``E`` sketched linear maps with stacked factors: expert ``e`` computes SKLinear's
    ``y = 1/(2L) · ((x S1[e]) U1[e] + (x U2[e]) S2[e]) + b[e]``.

    The factors are SKLinear's with a leading expert dimension — ``S1`` ``(E, in, Lk)``,
    ``U1`` ``(E, Lk, out)``, ``U2`` ``(E, in, Lk)``, ``S2`` ``(E, Lk, out)``, ``bias``
    ``(E, out)`` — the layout batched and grouped products need. Initialisation, fits
    (``init="svd"``: each expert's best rank-``2Lk`` fit, optionally from its own
    calibration Gram; ``"sketch"``: random sign sketches) and the read-only ``weight``
    are :class:`~panther_lite.nn.layer_base.SketchedLayer`'s, applied expert by expert.

    It is the per-projection part of :class:`~panther_lite.nn.SKExperts`, which routes
    tokens through it; it has no forward of its own and no dense layer class of its own
    (``to_dense``/``from_dense`` raise TypeError: densify the whole ``SKExperts``).

    Args:
        num_experts: ``E``.
        in_features, out_features: each expert's input and output sizes.
        num_terms, low_rank: ``L`` and ``k``, shared by every expert.
        W_init: optional dense weights in the dense layout (below) to represent.
        bias: learn a bias per expert.
        device, dtype: of the factors.
        transposed: the dense layout is ``(E, in, out)`` (gpt-oss) instead of ``(E, out, in)``
            (Mixtral, Qwen-MoE, OLMoE: ``nn.Linear``'s layout per expert).
        init, seed: as for :class:`~panther_lite.nn.SKLinear`.
    """

    __constants__ = ["num_experts", "in_features", "out_features", "num_terms", "low_rank", "transposed"]

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        num_terms: int,
        low_rank: int,
        W_init: Optional[Tensor] = None,
        bias: bool = True,
        device=None,
        dtype: Optional[torch.dtype] = None,
        *,
        transposed: bool = False,
        init: str = "sketch",
        seed: Optional[int] = None,
    ) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_terms, low_rank, init, seed)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.transposed = bool(transposed)
        self._register_factors((self.num_experts,), in_features, out_features, bias, factory_kwargs, W_init)
        self._initialize("W_init", W_init, None)

    @property
    def dense_weight_shape(self) -> Tuple[int, int, int]:
        """``(E, out, in)``, or ``(E, in, out)`` when ``transposed``."""
        inner = (self.in_features, self.out_features) if self.transposed else (self.out_features, self.in_features)
        return (self.num_experts, *inner)

    @property
    def _weight_layout(self) -> str:
        inner = "in_features, out_features" if self.transposed else "out_features, in_features"
        return f"(num_experts, {inner})"

    def _expert_matrix(self, weight: Tensor, expert: int) -> Tensor:
        """Expert ``expert``'s weight as ``(out, in)``."""
        return weight[expert].t() if self.transposed else weight[expert]

    def _factor_values(
        self, weight: Tensor, init: str, gram: Optional[Tensor], generator: Optional[torch.Generator], fit: str,
        output_gram: Optional[Tensor] = None,
    ) -> Tuple[Tensor, ...]:
        """SketchedLayer's fit of each expert's matrix (in its own decomposition dtype, so no
        float64 copy of the whole stack is made), stacked; ``output_gram`` holds one metric per
        expert (leading dimension ``num_experts``)."""
        per_expert = [
            super(SKStackedLinear, self)._factor_values(
                self._expert_matrix(weight, e), init, None if gram is None else gram[e], generator, fit,
                None if output_gram is None else output_gram[e],
            )
            for e in range(self.num_experts)
        ]
        return tuple(torch.stack(values) for values in zip(*per_expert))

    def _check_gram(self, gram: Optional[Tensor], init: str) -> None:
        """A stack of per-expert Grams ``(E, in, in)``, each checked like a layer's."""
        if gram is None:
            return
        if init != "svd":
            raise ValueError("a calibration gram is only used by init='svd'")
        check_tensor("gram", gram)
        if gram.dim() != 3 or gram.shape[0] != self.num_experts:
            raise ValueError(
                f"gram must be one Gram per expert, shape (num_experts, in_features, in_features) = "
                f"({self.num_experts}, {self.in_features}, {self.in_features}), got {tuple(gram.shape)}"
            )
        for e in range(self.num_experts):
            check_gram(gram[e], self.in_features, self._fan_in_name, name=f"gram[{e}]")

    def effective_weight(self) -> Tensor:
        """The dense weights this stack applies, in the dense layout (:attr:`dense_weight_shape`).
        Differentiable with respect to ``S1``, ``S2``."""
        dtype = self.S1.dtype
        product = self.scale * (self.S1 @ self.U1.to(dtype) + self.U2.to(dtype) @ self.S2)  # (E, in, out)
        return product if self.transposed else product.transpose(-1, -2)

    def parameter_counts(self) -> SketchSize:
        """Trainable (S factors + biases) and stored (plus U buffers) counts of all experts."""
        one = sketch_size(self.in_features, self.out_features, self.num_terms, self.low_rank, self.bias is not None)
        return SketchSize(trainable=self.num_experts * one.trainable, stored=self.num_experts * one.stored)

    def _dense_size(self) -> int:
        return self.num_experts * dense_size(self.in_features, self.out_features, self.bias is not None)

    def operands(self, input: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(input, S1, U1, U2, S2, bias)`` in the dtype the products run in: the sketches in
        the factors' dtype, then autocast's casts (TypeError/ValueError for an input of another
        dtype or device outside autocast)."""
        operands = cast_operands(input, self.S1, self.U1, self.U2, self.S2, self.bias)
        check_operands(*operands, what=type(self).__name__)
        return operands

    def stacked_operands(self, input: Tensor) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(input, left, right, bias)`` with ``left = [S1 | U2]`` ``(E, in, 2Lk)`` and
        ``right = [U1; S2] / (2L)`` ``(E, 2Lk, out)``: expert ``e`` maps ``x`` to
        ``(x·left[e])·right[e] + bias[e]``. Without autograd (and without per-call casts) the
        concatenations are cached while the factors are unchanged
        (:mod:`~panther_lite.nn.factor_cache`)."""
        x, S1, U1, U2, S2, bias = self.operands(input)
        needs_grad = torch.is_grad_enabled() and (S1.requires_grad or S2.requires_grad)
        if needs_grad or torch.compiler.is_compiling() or S1 is not self.S1 or U1 is not self.U1:
            return x, torch.cat((S1, U2), dim=-1), torch.cat((U1, S2), dim=-2) * self.scale, bias
        left, right = stacked_factors(S1, U1, U2, S2, self.scale)
        return x, left, right, bias

    def to_dense(self) -> nn.Module:
        raise TypeError("SKStackedLinear has no dense layer of its own: call SKExperts.to_dense()")

    @classmethod
    def from_dense(cls, dense: nn.Module, *args, **kwargs) -> "SKStackedLinear":
        raise TypeError("SKStackedLinear is built by SKExperts (SKExperts.from_experts), not from a dense layer")

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
            f"num_terms={self.num_terms}, low_rank={self.low_rank}, bias={self.bias is not None}"
            + (", transposed=True" if self.transposed else "")
        )
