"""Global sizes: one stored-entry budget spread over the pooled layers (:mod:`.allocation`),
weighted by each layer's gain to the model's output (:mod:`.sensitivity`)."""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional

from torch import Tensor

from ...nn import sketch_size
from ..records import KEPT_DENSE, LayerRecord
from .allocation import Allocation, BudgetTooSmall, LayerSpectrum, allocate_budget, largest_sketch, whitened_energy
from .sizes import PlanNote, RankMultiple


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
    (:func:`~panther_lite.conversion.planning.allocation.whitened_energy`), its Gram freed.

    Each part of a record holding several weight stacks (a mixture-of-experts module) is sized
    on its own, weighted by its record's gain; the module converts or stays dense whole, so
    when the plan keeps only some of its parts dense, the whole module stays dense if the
    budget left pays for it, else those parts get their largest sketch (:func:`_settle`).
    Notes are by part name."""
    gains = _usable_gains(gains)
    energies = {} if energies is None else energies
    parts = [(record, part) for record in records for part in record.parts]
    budget = ratio * sum(part.dense_params for _, part in parts)
    spectra = [
        LayerSpectrum(
            part.fan_in, part.fan_out, part.has_bias, _energy(record, part, grams, energies),
            importance=gains.get(part.name, gains.get(record.name, 1.0)), multiple=multiple_of(part), copies=part.copies,
        )
        for record, part in parts
    ]
    try:
        plan = allocate_budget(spectra, budget, num_terms=num_terms)
    except BudgetTooSmall as error:
        dense = sum(part.dense_params for _, part in parts)
        message = f"param_ratio={ratio:g} with allocation='global' is below {error.minimum / dense:.4g}: {error}"
        raise BudgetTooSmall(message, error.minimum, error.minimum / dense) from None
    plan = _settle(parts, spectra, plan, budget, num_terms)
    notes = {}
    for (_, part), spectrum, allocation in zip(parts, spectra, plan):
        share = allocation.stored / budget
        if allocation.low_rank is None:
            cheapest = part.copies * sketch_size(part.fan_in, part.fan_out, num_terms, 1, part.has_bias).stored
            if part.to_convert:
                part.skip(KEPT_DENSE, _dense_reason(part, cheapest, share))
        else:
            part.num_terms, part.low_rank = num_terms, allocation.low_rank
        aligned = part.to_convert and allocation.low_rank % spectrum.multiple == 0
        notes[part.name] = PlanNote(rank_multiple=spectrum.multiple if aligned else 1, budget_share=share)
    return notes


def _settle(parts, spectra: List[LayerSpectrum], plan: List[Allocation], budget: float, num_terms: int) -> List[Allocation]:
    """``plan`` with every record of several parts wholly dense or wholly sketched: a record
    whose plan keeps some of its parts dense becomes dense whole when the budget left pays for
    it (or a dense part has no sketch), else its dense parts get their largest sketch (each
    cheaper than dense)."""
    plan = list(plan)
    left = budget - sum(allocation.stored for allocation in plan)
    by_record: Dict[int, List[int]] = {}
    for index, (record, part) in enumerate(parts):
        if part is not record:
            by_record.setdefault(id(record), []).append(index)
    for indices in by_record.values():
        dense = [i for i in indices if plan[i].low_rank is None]
        if not dense or len(dense) == len(indices):
            continue
        sketched = [i for i in indices if i not in dense]
        extra = sum(parts[i][1].dense_params - plan[i].stored for i in sketched)
        largest = {i: largest_sketch(spectra[i], num_terms) for i in dense}
        if extra <= left or any(found is None for found in largest.values()):
            for i in sketched:
                plan[i] = Allocation(None, parts[i][1].dense_params, 0.0)
            left -= extra
        else:
            for i, found in largest.items():
                left += plan[i].stored - found.stored
                plan[i] = found
    return plan


def _energy(record: LayerRecord, part: LayerRecord, grams: Dict[str, Optional[Tensor]], energies: Dict[str, Tensor]) -> Tensor:
    """The part's whitened spectrum: given, else from its Gram in ``grams`` (a one-matrix layer)
    or its kind's statistics-free spectra."""
    if part.name in energies:
        return energies[part.name]
    if part is record:
        return whitened_energy(record.weight_matrix(), grams.get(record.name))
    return record.strategy.energies(record, None)[part.name]


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
