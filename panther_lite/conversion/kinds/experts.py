"""The mixture-of-experts kind: transformers' fused experts modules (Mixtral, Qwen2/Qwen3-MoE,
OLMoE, gpt-oss, ...: 3-D ``gate_up_proj``/``up_proj`` ``[E, out, in]`` and ``down_proj``),
sketched whole as :class:`~panther_lite.nn.SKExperts` and frozen as
:class:`~panther_lite.conversion.kinds.frozen_experts.FrozenExperts`.

Its record (:class:`ExpertsRecord`) has one part per projection (:class:`ExpertsPart`): ``E``
matrices of one shape that share one ``(num_terms, low_rank)`` (the factors are stacked), sized
on their own by the planners (a global allocation weighs every expert's spectrum), reported on
a row each. Its strategy (``"experts"``, :mod:`~panther_lite.conversion.kinds.strategy`) records
a Gram per expert and projection from the rows the router sends it
(:mod:`~panther_lite.conversion.calibration.experts`), and fits with
:mod:`~panther_lite.conversion.fitting.experts`. The router stays dense: it is part of the
block, not of the experts module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn import SKExperts
from ...nn.rank_selection import dense_size
from ...nn.skexperts import dense_projections
from ...nn.validation import check_sketch_rank
from ..records import LayerRecord
from .base import LayerKind
from .frozen_experts import FrozenExperts

__all__ = ["ExpertsKind", "ExpertsRecord", "ExpertsPart", "EXPERTS"]


def _projections(module: nn.Module) -> Optional[List[Tuple[str, Tensor, Optional[Tensor]]]]:
    """``[(name, weight, bias)]`` of a transformers-style experts module's projections, or None
    when ``module`` is not one (no 3-D up and down projection weights)."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    found = []
    for name in (first, "down_proj"):
        weight = getattr(module, name, None)
        if not isinstance(weight, Tensor) or weight.dim() != 3:
            return None
        bias = getattr(module, f"{name}_bias", None) if getattr(module, "has_bias", False) else None
        found.append((name, weight, bias))
    return found


class ExpertsPart:
    """One projection of an experts module as the planners see it: ``copies`` (= E) matrices
    ``fan_out × fan_in`` sharing one size; its status is its record's (a part kept dense keeps
    the whole module dense), its ``reason`` adds its own notes (experts fitted data-free)."""

    def __init__(self, record: "ExpertsRecord", projection: str, weight: Tensor, bias: Optional[Tensor], transposed: bool):
        self.record, self.projection, self.name = record, projection, f"{record.name}.{projection}"
        self.kind, self.module, self.transposed = record.kind, record.module, transposed
        self.has_bias, self.notes = bias is not None, ""
        self.num_terms: Optional[int] = None
        self.low_rank: Optional[int] = None

    @property
    def weight(self) -> Tensor:
        """The module's weight stack as it is now (a pipeline loading weights later replaces it)."""
        return getattr(self.module, self.projection)

    @property
    def bias(self) -> Optional[Tensor]:
        return getattr(self.module, f"{self.projection}_bias") if self.has_bias else None

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def reason(self) -> str:
        return "; ".join(text for text in (self.record.reason, self.notes) if text)

    @property
    def to_convert(self) -> bool:
        return self.record.to_convert

    def skip(self, status: str, reason: str) -> None:
        self.record.skip(status, f"{self.projection}: {reason}")

    @property
    def copies(self) -> int:
        return self.weight.shape[0]

    @property
    def fan_in(self) -> int:
        return self.weight.shape[1 if self.transposed else 2]

    @property
    def fan_out(self) -> int:
        return self.weight.shape[2 if self.transposed else 1]

    @property
    def dense_params(self) -> int:
        return self.copies * dense_size(self.fan_in, self.fan_out, self.has_bias)

    @property
    def shape(self) -> tuple:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def expert_matrix(self, expert: int) -> Tensor:
        """Expert ``expert``'s weight ``(fan_out, fan_in)`` (a view)."""
        return self.weight[expert].t() if self.transposed else self.weight[expert]

    def weight_stack(self) -> Tensor:
        """``(E, fan_out, fan_in)`` (a view)."""
        return self.weight.transpose(1, 2) if self.transposed else self.weight

    def apply(self, expert: int, rows: Tensor) -> Tensor:
        """The dense expert's projection of ``rows`` ``(S, fan_in) -> (S, fan_out)``."""
        bias = None if self.bias is None else self.bias[expert]
        return nn.functional.linear(rows, self.expert_matrix(expert), bias)


@dataclass
class ExpertsRecord(LayerRecord):
    """The record of an experts module: its parts are its projections (see :class:`ExpertsPart`)."""

    _parts: List[ExpertsPart] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        transposed = bool(getattr(self.module, "is_transposed", False))
        self._parts = [ExpertsPart(self, *found, transposed) for found in _projections(self.module)]

    @property
    def parts(self) -> List[ExpertsPart]:
        return self._parts

    @property
    def dense_params(self) -> int:
        return 0 if self.is_lazy else sum(part.dense_params for part in self._parts)

    def weight_matrix(self) -> Tensor:
        raise TypeError(f"{self.name!r} holds one weight stack per projection: read its parts")

    @property
    def sizes(self) -> Dict[str, Tuple[int, int]]:
        """The planned ``(num_terms, low_rank)`` of each projection."""
        return {part.projection: (part.num_terms, part.low_rank) for part in self._parts}


class ExpertsKind(LayerKind):
    """transformers' fused experts modules (see the module docstring), recognised by their 3-D
    projection weights and sketched whole as :class:`~panther_lite.nn.SKExperts`."""

    sequential_regression = False
    strategy = "experts"

    def __init__(self) -> None:
        super().__init__("Experts", nn.Module, SKExperts, frozen_type=FrozenExperts, overridden=(), linear=True)

    def base(self, module_type: type) -> Optional[type]:
        return None

    def matches(self, module: nn.Module) -> bool:
        return not isinstance(module, (SKExperts, FrozenExperts)) and _projections(module) is not None

    def custom_behaviour(self, module: nn.Module) -> Optional[str]:
        return None

    def unsupported(self, module: nn.Module) -> Optional[str]:
        try:
            dense_projections(module)
        except (TypeError, ValueError) as error:
            return f"SKExperts cannot stand for it: {error}"
        return None

    def weight(self, module: nn.Module) -> Tensor:
        return _projections(module)[0][1]

    def bias(self, module: nn.Module) -> Optional[Tensor]:
        return _projections(module)[0][2]

    def tensors(self, module: nn.Module) -> Dict[str, Tensor]:
        found = {}
        for name, weight, bias in _projections(module):
            found[name] = weight
            if bias is not None:
                found[f"{name}_bias"] = bias
        return found

    def call_input(self, args: tuple, kwargs: dict) -> Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def input_dimension(self, module: nn.Module) -> Tuple[int, int, str]:
        _, weight, _ = _projections(module)[0]
        transposed = bool(getattr(module, "is_transposed", False))
        return -1, weight.shape[1 if transposed else 2], "last dimension (hidden size)"

    # ------------------------------------------------------------------ records
    def record(self, name: str, module: nn.Module) -> ExpertsRecord:
        return ExpertsRecord(name, module, self)

    # ------------------------------------------------------------------ building
    def build(self, module: nn.Module, num_terms: int, low_rank: int, *, sizes=None, **fit) -> SKExperts:
        return SKExperts(module, num_terms, low_rank, sizes=sizes, **fit)

    def build_placeholder(self, module: nn.Module, num_terms: int, low_rank: int, device=None, *, sizes=None):
        return SKExperts(module, num_terms, low_rank, sizes=sizes, init="sketch", seed=0, device=device)

    def match_trainability(self, new: nn.Module, old: nn.Module) -> None:
        new.train(old.training)
        tensors = self.tensors(old)
        for name, param in new.named_parameters():
            projection, _, attr = name.partition(".")
            if projection in tensors:
                source = tensors.get(f"{projection}_bias") if attr == "bias" else tensors[projection]
                param.requires_grad_(source.requires_grad)

    def densify(self, layer: SKExperts) -> nn.Module:
        dense = layer.to_dense()
        dense.train(layer.training)
        for name, projection in zip(layer.sizes, layer.projections()):
            getattr(dense, name).requires_grad_(projection.S1.requires_grad)
            if projection.bias is not None:
                getattr(dense, f"{name}_bias").requires_grad_(projection.bias.requires_grad)
        return dense

    def frozen_twin(self, layer: SKExperts) -> FrozenExperts:
        frozen = FrozenExperts.from_sketched(layer)
        frozen.requires_grad_(any(p.requires_grad for p in layer.parameters())).train(layer.training)
        return frozen

    def dense_shape(self, layer: nn.Module) -> List[int]:
        if isinstance(layer, FrozenExperts):
            return list(layer.dense_shape)
        return list(layer.projections()[0].dense_weight_shape)

    # ------------------------------------------------------------------ conversion configs
    def config_entry(self, layer: nn.Module, frozen: bool) -> dict:
        sizes = layer.sizes
        num_terms, low_rank = next(iter(sizes.values()))
        bias = layer.has_bias if frozen else layer.projections()[0].bias is not None
        return dict(
            kind=self.sketched_type.__name__, dense=self.name, shape=self.dense_shape(layer), num_terms=num_terms,
            low_rank=low_rank, bias=bias, sizes={name: list(pair) for name, pair in sizes.items()},
        )

    def check_entry(self, module: nn.Module, entry: dict, name: str) -> dict:
        projections = {found[0]: found for found in _projections(module)}
        sizes = entry.get("sizes", {})
        if not isinstance(sizes, dict) or not set(sizes) <= set(projections):
            raise ValueError(
                f"layer {name!r}: 'sizes' must map the experts' projections {sorted(projections)} to "
                f"[num_terms, low_rank], got {sizes!r}"
            )
        transposed = bool(getattr(module, "is_transposed", False))
        found = {}
        for projection, (_, weight, _) in projections.items():
            pair = sizes.get(projection, [entry["num_terms"], entry["low_rank"]])
            ok = isinstance(pair, (list, tuple)) and len(pair) == 2
            if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair):
                raise ValueError(f"layer {name!r}: sizes[{projection!r}] must be [num_terms, low_rank] >= 1, got {pair!r}")
            fan_out, fan_in = (weight.shape[2], weight.shape[1]) if transposed else weight.shape[1:]
            check_sketch_rank(pair[0], pair[1], fan_in, fan_out, layer=f"{name}.{projection}")
            found[projection] = tuple(pair)
        return {"sizes": found}


EXPERTS = ExpertsKind()
