"""The per-layer record of a conversion: one candidate layer, its kind and sizes, and what
convert decided for it (converted, kept dense or skipped, with the reason)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

import torch
import torch.nn as nn
from torch import Tensor

from ..nn import dense_size
from ..nn.validation import check_finite

CONVERTED, KEPT_DENSE, SKIPPED = "converted", "kept dense", "skipped"


class LayerReader(Protocol):
    """What a record reads of its layer's kind (a :class:`~panther_lite.conversion.kinds.LayerKind`
    provides it): the dense tensors of ``module``, and its weight as a ``(fan_out, fan_in)`` matrix."""

    def weight(self, module: nn.Module) -> Tensor: ...

    def bias(self, module: nn.Module) -> Optional[Tensor]: ...

    def tensors(self, module: nn.Module) -> Dict[str, Tensor]: ...

    def weight_matrix(self, module: nn.Module) -> Tensor: ...


@dataclass
class LayerRecord:
    """One selected layer, its :class:`~panther_lite.conversion.kinds.LayerKind` (``kind``) and
    the :class:`~panther_lite.conversion.kinds.strategy.LayerStrategy` calibrating and fitting it
    (``strategy``, set with the record by :func:`~panther_lite.conversion.kinds.strategy.new_record`).
    ``status`` starts as ``"converted"`` (planned) and becomes ``"kept dense"`` or
    ``"skipped"`` with a ``reason``; a planner sets ``num_terms`` and ``low_rank`` of the
    layers it converts. ``routed``: the layer belongs to one expert of a mixture of experts
    (:mod:`~panther_lite.conversion.routing`). ``output_gram``: the metric on the layer's
    outputs its fit weighs the error by (the next-token Fisher with ``output_fisher=True``,
    :mod:`~panther_lite.conversion.planning.output_fisher`; None: every output alike)."""

    name: str
    module: nn.Module
    kind: LayerReader
    status: str = CONVERTED
    reason: str = ""
    num_terms: Optional[int] = None
    low_rank: Optional[int] = None
    routed: bool = False
    strategy: Any = field(default=None, repr=False, compare=False)
    output_gram: Optional[Tensor] = field(default=None, repr=False, compare=False)

    @property
    def to_convert(self) -> bool:
        return self.status == CONVERTED

    @property
    def has_bias(self) -> bool:
        return self.kind.bias(self.module) is not None

    @property
    def is_lazy(self) -> bool:
        return isinstance(self.kind.weight(self.module), nn.parameter.UninitializedParameter)

    @property
    def device(self) -> torch.device:
        return self.kind.weight(self.module).device

    @property
    def dtype(self) -> torch.dtype:
        return self.kind.weight(self.module).dtype

    @property
    def shape(self) -> Optional[tuple]:
        """The dense weight's shape in the module's own layout (None while lazy)."""
        return None if self.is_lazy else tuple(self.kind.weight(self.module).shape)

    def weight_matrix(self) -> Tensor:
        """The weight as a ``(fan_out, fan_in)`` matrix (a view): ``y = x·Wᵀ`` for the linear
        kinds, the kernel's unfolding ``C_out × (C_in·k1·k2·…)`` for convolutions."""
        return self.kind.weight_matrix(self.module)

    @property
    def fan_in(self) -> int:
        return self.weight_matrix().shape[1]

    @property
    def fan_out(self) -> int:
        return self.weight_matrix().shape[0]

    @property
    def rank(self) -> int:
        """The planned sketch's rank ``2·num_terms·low_rank`` (its sizes must be set)."""
        return 2 * self.num_terms * self.low_rank

    @property
    def dense_params(self) -> int:
        """Parameters of the dense layer (0 while a lazy module is uninitialized)."""
        return 0 if self.is_lazy else dense_size(self.fan_in, self.fan_out, self.has_bias)

    @property
    def parts(self) -> List["LayerRecord"]:
        """The weight matrices planned one by one: the layer itself. A kind holding several
        (a mixture-of-experts module: one stack per projection) gives records with one part
        per stack; a part has a record's sizing attributes, ``copies`` matrices of
        ``fan_out × fan_in`` (``weight_stack``), and shares its record's status."""
        return [self]

    @property
    def copies(self) -> int:
        """How many ``fan_out × fan_in`` matrices of one size this part holds (1 for a layer)."""
        return 1

    def weight_stack(self) -> Tensor:
        """The weight matrices ``(copies, fan_out, fan_in)`` (views)."""
        return self.weight_matrix().unsqueeze(0)

    def skip(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason

    def note(self, text: str) -> None:
        """Add ``text`` to the report's ``reason`` (after what is there)."""
        self.reason = f"{self.reason}; {text}" if self.reason else text


def check_finite_weights(records: List[LayerRecord]) -> None:
    """ValueError naming the first layer whose weight or bias holds inf or NaN (a fit of it
    would spread the bad entries over every output); weights still on the meta device (a
    pipeline loads them later) are checked by whoever loads them."""
    for record in records:
        for attr, tensor in record.kind.tensors(record.module).items():
            if not tensor.is_meta:
                check_finite(attr, tensor, layer=record.name)


def records_entry(records: List[LayerRecord]) -> dict:
    """Each record's status and reason, and its parts' own notes (experts fitted data-free), as
    JSON: what a fit adds to the report besides its FitResult."""
    return dict(records={r.name: [r.status, r.reason] for r in records},
                notes={p.name: p.notes for r in records for p in r.parts if p is not r and hasattr(p, "notes")})


def restore_records(records: List[LayerRecord], saved: dict) -> None:
    """The statuses, reasons and parts' notes :func:`records_entry` saved, set on ``records``."""
    for record in records:
        if record.name in saved["records"]:
            record.status, record.reason = saved["records"][record.name]
        for part in record.parts:
            if part.name in saved["notes"]:
                part.notes = saved["notes"][part.name]
