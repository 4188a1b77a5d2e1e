"""Sizes per layer: ``(num_terms, low_rank)`` for each selected layer from the size arguments
(``num_terms``/``low_rank``, ``param_ratio``, ``rank_pattern``, ``allocation``, ``align``), or
"kept dense" when no configuration stores fewer parameters than the dense layer.

A plan is the list of :class:`~panther_lite.conversion.layer_record.LayerRecord` itself:
a planner fills ``num_terms``/``low_rank`` of the records still to convert, or marks them
kept dense, and returns per-layer :class:`PlanNote` s for the report. :func:`plan_sizes` is
the per-layer ("uniform") planner; :func:`plan_global` spends one budget over all layers
sized by the default ``param_ratio`` (:mod:`.allocation`).
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch import Tensor

from ..nn import select_config, sketch_size
from ..nn.rank_selection import resolve_rank_multiple
from ..nn.validation import check_fraction, check_positive_int
from .allocation import BudgetTooSmall, LayerSpectrum, allocate_budget, whitened_energy
from .layer_record import KEPT_DENSE, LayerRecord
from .selection import compile_regex

RankSpec = Union[float, Tuple[int, int]]
ALLOCATIONS = ("uniform", "global")
RankMultiple = Callable[[LayerRecord], int]


@dataclass
class PlanNote:
    """What the planner applied to one layer, for the report: the ``rank_multiple``
    ``low_rank`` was rounded to (1: none) and, under a global allocation, the layer's
    ``budget_share`` (its stored entries over the global budget)."""

    rank_multiple: int = 1
    budget_share: float = float("nan")


def rank_multiple_for(align) -> RankMultiple:
    """``record -> multiple`` for ``align`` (None, "auto" or an int; see
    :func:`~panther_lite.nn.rank_selection.resolve_rank_multiple`), validated now."""
    resolve_rank_multiple(align, None, None)
    return lambda record: resolve_rank_multiple(align, record.module.weight.device, record.module.weight.dtype)


def check_ratio(name: str, value) -> float:
    """``value`` as a float in (0, 1]; ValueError naming ``name`` otherwise."""
    return check_fraction(name, value, "stored size as a fraction of the dense layer")


def check_rank_spec(name: str, value) -> RankSpec:
    """A ratio in (0, 1] or a ``(num_terms, low_rank)`` pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be a ratio or a (num_terms, low_rank) pair, got {value!r}")
        return (check_positive_int(f"{name} num_terms", value[0]), check_positive_int(f"{name} low_rank", value[1]))
    return check_ratio(name, value)


@dataclass
class SizeRequest:
    """The validated size arguments of :func:`~panther_lite.convert`.

    ``default``: the size of layers no pattern names (a ratio, a ``(num_terms, low_rank)``
    pair, or None); ``ratio_terms``: the ``num_terms`` used with ratios; ``patterns``:
    ``[(regex, key, spec)]`` from ``rank_pattern``, first match wins.
    """

    default: Optional[RankSpec]
    ratio_terms: int
    patterns: List[Tuple["re.Pattern", str, RankSpec]] = field(default_factory=list)

    def spec_for(self, name: str) -> Tuple[Optional[RankSpec], Optional[str]]:
        """``(spec, matching rank_pattern key or None)`` for the layer named ``name``."""
        for regex, key, spec in self.patterns:
            if regex.fullmatch(name):
                return spec, key
        return self.default, None


def _default_size(num_terms, low_rank, param_ratio) -> Tuple[Optional[RankSpec], int]:
    if param_ratio is not None:
        if low_rank is not None:
            raise ValueError(
                "param_ratio chooses low_rank: pass param_ratio (optionally with num_terms), "
                "or num_terms and low_rank, not both"
            )
        ratio_terms = 1 if num_terms is None else check_positive_int("num_terms", num_terms)
        return check_ratio("param_ratio", param_ratio), ratio_terms
    if num_terms is None and low_rank is None:
        return None, 1
    if num_terms is None or low_rank is None:
        raise ValueError(
            f"num_terms and low_rank go together (got num_terms={num_terms!r}, low_rank={low_rank!r}); "
            "or pass param_ratio to choose low_rank per layer"
        )
    return (check_positive_int("num_terms", num_terms), check_positive_int("low_rank", low_rank)), num_terms


def parse_sizes(num_terms, low_rank, param_ratio, rank_pattern) -> SizeRequest:
    """Validate the size arguments (ValueError/TypeError on bad or contradictory ones)."""
    default, ratio_terms = _default_size(num_terms, low_rank, param_ratio)
    request = SizeRequest(default, ratio_terms)
    if rank_pattern is not None:
        if not isinstance(rank_pattern, Mapping):
            raise TypeError(f"rank_pattern must be a dict {{regex: ratio or (num_terms, low_rank)}}, got {rank_pattern!r}")
        for key, value in rank_pattern.items():
            if not isinstance(key, str):
                raise TypeError(f"rank_pattern keys must be regex strings, got {key!r}")
            regex = compile_regex("rank_pattern key", rf"(?:.*\.)?(?:{key})")
            request.patterns.append((regex, key, check_rank_spec(f"rank_pattern[{key!r}]", value)))
    if default is None and not request.patterns:
        raise ValueError("give a size: param_ratio=..., or num_terms=... and low_rank=..., or a rank_pattern")
    return request


def choose_size(record: LayerRecord, spec: RankSpec, ratio_terms: int, multiple: int = 1) -> None:
    """Set ``record``'s (num_terms, low_rank), or mark it kept dense when nothing beats dense.
    A ratio gets the largest rank within it, rounded to ``multiple`` when that still fills
    90% of it (:func:`~panther_lite.nn.select_config`)."""
    dense = record.dense_params
    if isinstance(spec, tuple):
        pair = spec
    else:
        pair = select_config(
            record.fan_in, record.fan_out, spec, num_terms=ratio_terms, bias=record.has_bias, multiple=multiple
        )
    stored = None if pair is None else sketch_size(record.fan_in, record.fan_out, *pair, record.has_bias).stored
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
    """Give every record still to convert, except those named in ``pooled`` (left to
    :func:`plan_global`), its size from ``request`` (or keep it dense); ValueError when a
    rank_pattern key matches no selected layer or a layer has no size."""
    used, uncovered, notes = set(), [], {}
    for record in records:
        spec, key = request.spec_for(record.name)
        used.add(key)
        if not record.to_convert or record.name in pooled:
            continue
        if spec is None:
            uncovered.append(record.name)
            continue
        multiple = multiple_of(record)
        choose_size(record, spec, request.ratio_terms, multiple)
        if record.to_convert and not isinstance(spec, tuple):
            notes[record.name] = PlanNote(rank_multiple=multiple if record.low_rank % multiple == 0 else 1)
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


def pooled_records(records: List[LayerRecord], request: SizeRequest, allocation: str) -> List[LayerRecord]:
    """The records a global allocation sizes: those to convert that no rank_pattern key
    names (their size is the default ``param_ratio``); none for ``"uniform"``."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if allocation == "uniform":
        return []
    if not isinstance(request.default, float):
        raise ValueError(
            "allocation='global' spreads one budget over the layers: pass param_ratio=... "
            f"(the budget as a fraction of their dense size), not num_terms/low_rank (got {request.default!r})"
        )
    return [record for record in records if record.to_convert and request.spec_for(record.name)[1] is None]


def plan_global(
    records: List[LayerRecord],
    ratio: float,
    num_terms: int,
    multiple_of: RankMultiple,
    grams: Dict[str, Optional[Tensor]],
    gains: Dict[str, float],
    energies: Optional[Dict[str, Tensor]] = None,
) -> Dict[str, PlanNote]:
    """Size ``records`` together so their stored entries stay within ``ratio`` of their dense
    size, minimising the summed relative squared output error predicted from each layer's
    whitened spectrum (``grams[name]``, or the weight's own spectrum when None), each weighted
    by the layer's squared gain to the model's output (``gains[name]``, default 1; see
    :mod:`.sensitivity`); layers the budget is better spent keeping dense, or no sketch
    beats, are kept dense. Gains that are not finite numbers >= 0 (a model whose output goes
    non-finite under the sensitivity probe) are dropped with a warning naming the layers:
    the plan then weighs every layer alike (relative errors alone). ``energies[name]``, when
    given, is the layer's whitened spectrum already computed
    (:func:`~panther_lite.conversion.allocation.whitened_energy`), its Gram freed."""
    gains = _usable_gains(gains)
    energies = {} if energies is None else energies
    budget = ratio * sum(record.dense_params for record in records)
    spectra = [
        LayerSpectrum(
            record.fan_in, record.fan_out, record.has_bias,
            energies[record.name] if record.name in energies
            else whitened_energy(record.weight_matrix(), grams.get(record.name)),
            importance=gains.get(record.name, 1.0), multiple=multiple_of(record),
        )
        for record in records
    ]
    try:
        plan = allocate_budget(spectra, budget, num_terms=num_terms)
    except BudgetTooSmall as error:
        dense = sum(record.dense_params for record in records)
        message = f"param_ratio={ratio:g} with allocation='global' is below {error.minimum / dense:.4g}: {error}"
        raise BudgetTooSmall(message, error.minimum, error.minimum / dense) from None
    notes = {}
    for record, spectrum, allocation in zip(records, spectra, plan):
        share = allocation.stored / budget
        if allocation.low_rank is None:
            cheapest = sketch_size(record.fan_in, record.fan_out, num_terms, 1, record.has_bias).stored
            record.skip(KEPT_DENSE, _dense_reason(record, cheapest, share))
        else:
            record.num_terms, record.low_rank = num_terms, allocation.low_rank
        aligned = record.to_convert and allocation.low_rank % spectrum.multiple == 0
        notes[record.name] = PlanNote(rank_multiple=spectrum.multiple if aligned else 1, budget_share=share)
    return notes


def _usable_gains(gains: Dict[str, float]) -> Dict[str, float]:
    """``gains``, or ``{}`` (every layer weighted 1) with a warning when any is NaN, infinite
    or negative: one unusable weight makes the errors incomparable."""
    bad = sorted(name for name, gain in gains.items() if not (math.isfinite(gain) and gain >= 0))
    if not bad:
        return gains
    warnings.warn(
        f"allocation='global': layers {bad[:5]} have a non-finite output gain (the model's output went NaN/inf "
        "when noise was added to their outputs on the calibration batch), so the gains cannot weigh the layers' "
        "errors; allocating with every layer weighted alike (relative output errors alone)",
        UserWarning,
        stacklevel=4,
    )
    return {}


def _dense_reason(record: LayerRecord, cheapest: int, share: float) -> str:
    if cheapest >= record.dense_params:
        return (
            f"no sketch stores fewer parameters than the dense layer's {record.dense_params:,} "
            f"(rank 1 stores {cheapest:,})"
        )
    return (
        f"the global budget is better spent keeping it dense ({share:.1%} of the budget): a sketch small enough "
        "to pay for itself would lose more of its output than the rank it buys elsewhere"
    )
