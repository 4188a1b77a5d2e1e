"""Sizes per layer, uniform: ``(num_terms, low_rank)`` for each selected layer from the
config's size request and ``align``, or "kept dense" when no configuration stores fewer
parameters than the dense layer; and which layers a global allocation sizes instead.

A plan is the list of :class:`~panther_lite.conversion.records.LayerRecord` itself: a planner
fills ``num_terms``/``low_rank`` of the records still to convert, or marks them kept dense,
and returns per-layer :class:`PlanNote` s for the report. :func:`plan_sizes` is the
per-layer ("uniform") planner; :func:`~panther_lite.conversion.planning.global_plan.plan_global`
spends one budget over all layers sized by the default ``param_ratio``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ...nn import select_config, sketch_size
from ...nn.rank_selection import resolve_rank_multiple
from ..config import ConvertConfig
from ..size_request import RankSpec, SizeRequest
from ..records import KEPT_DENSE, LayerRecord, check_finite_weights

RankMultiple = Callable[[LayerRecord], int]


@dataclass
class PlanNote:
    """What the planner applied to one layer, for the report: the ``rank_multiple``
    ``low_rank`` was rounded to (1: none) and, under a global allocation, the layer's
    ``budget_share`` (its stored entries over the global budget)."""

    rank_multiple: int = 1
    budget_share: float = float("nan")


def rank_multiple_for(align) -> RankMultiple:
    """``record -> multiple`` for the config's ``align`` (None, "auto" or an int; see
    :func:`~panther_lite.nn.rank_selection.resolve_rank_multiple`)."""
    return lambda record: resolve_rank_multiple(align, record.device, record.dtype)


def choose_size(record: LayerRecord, spec: RankSpec, ratio_terms: int, multiple: int = 1) -> None:
    """Set ``record``'s (num_terms, low_rank), or mark it kept dense when nothing beats dense.
    A ratio gets the largest rank within it, rounded to ``multiple`` when that still fills
    90% of it (:func:`~panther_lite.nn.select_config`). ``record`` may be a part (its
    ``copies`` matrices share the size)."""
    dense = record.dense_params
    if isinstance(spec, tuple):
        pair = spec
    else:
        pair = select_config(
            record.fan_in, record.fan_out, spec, num_terms=ratio_terms, bias=record.has_bias, multiple=multiple
        )
    stored = None if pair is None else record.copies * sketch_size(record.fan_in, record.fan_out, *pair, record.has_bias).stored
    if pair is None or stored >= dense:
        if isinstance(spec, tuple):
            reason = (
                f"num_terms={pair[0]}, low_rank={pair[1]} would store {stored:,} parameters, "
                f"not fewer than the dense layer's {dense:,}"
            )
        else:
            reason = (
                f"no configuration with num_terms={ratio_terms} stores at most {spec:g} of the dense "
                f"layer's {dense:,} parameters and fewer than dense"
            )
        record.skip(KEPT_DENSE, reason)
        return
    record.num_terms, record.low_rank = pair


def plan_sizes(
    records: List[LayerRecord], request: SizeRequest, multiple_of: RankMultiple = lambda record: 1, pooled=()
) -> Dict[str, PlanNote]:
    """Give every part of every record still to convert, except those named in ``pooled`` (left
    to :func:`plan_global`), its size from ``request`` (or keep it dense); ValueError when a
    rank_pattern key matches no selected layer or a layer has no size."""
    used, uncovered, notes = set(), [], {}
    for record in records:
        for part in record.parts:
            spec, key = part_spec(request, record, part)
            used.add(key)
            if not part.to_convert or record.name in pooled:
                continue
            if spec is None:
                uncovered.append(part.name)
                continue
            multiple = multiple_of(part)
            choose_size(part, spec, request.ratio_terms, multiple)
            if part.to_convert and not isinstance(spec, tuple):
                notes[part.name] = PlanNote(rank_multiple=multiple if part.low_rank % multiple == 0 else 1)
    unused = [key for _, key, _ in request.patterns if key not in used]
    if unused:
        raise ValueError(
            f"rank_pattern keys {unused} matched no selected layer (selected: {[record.name for record in records]})"
        )
    if uncovered:
        raise ValueError(
            f"layers {uncovered} match no rank_pattern key and no default size was given: "
            "pass param_ratio=..., or num_terms=... and low_rank=..."
        )
    return notes


def part_spec(request: SizeRequest, record: LayerRecord, part: LayerRecord) -> Tuple[Optional[RankSpec], Optional[str]]:
    """``(spec, rank_pattern key or None)`` of one part of ``record``: a key naming the part
    (``"down_proj"`` for a mixture-of-experts projection) wins over one naming its record."""
    spec, key = request.spec_for(part.name)
    if key is None and part is not record:
        spec, key = request.spec_for(record.name)
    return spec, key


def pooled_records(records: List[LayerRecord], request: SizeRequest, allocation: str) -> List[LayerRecord]:
    """The records a global allocation sizes: those to convert that no rank_pattern key
    names, nor any of their parts (their size is the default ``param_ratio``); none for
    ``"uniform"``."""
    if allocation == "uniform":
        return []
    return [
        record for record in records
        if record.to_convert and all(part_spec(request, record, part)[1] is None for part in record.parts)
    ]


def plan_uniform(records: List[LayerRecord], config: ConvertConfig) -> Tuple[Dict[str, PlanNote], List[LayerRecord]]:
    """The planning every pipeline starts with: size the records no global budget pools
    (:func:`plan_sizes`), check that the layers still to convert hold finite weights, and
    return ``(notes, pooled records)``, the pooled ones left for a global plan."""
    pooled = pooled_records(records, config.sizes, config.allocation)
    notes = plan_sizes(records, config.sizes, rank_multiple_for(config.align), pooled={r.name for r in pooled})
    check_finite_weights([record for record in records if record.to_convert])
    return notes, pooled


