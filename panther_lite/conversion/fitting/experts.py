"""Fitting a mixture-of-experts module: :class:`~panther_lite.nn.SKExperts` at the planned size of
each projection, every expert from its own calibration Gram (or its weights alone when its rows
are too few), measured expert by expert for the report (one row per projection)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..calibration.experts import ExpertsRecorder
from ..calibration.tokens import UNALIGNED_NOTE
from .layer import FitResult, check_built, error_ratio, output_error_terms
from .planned import warn_uncalibrated

__all__ = ["fit_experts", "measure_weights"]

Terms = List[Tuple[float, float]]  # per expert (numerator, denominator) of a squared relative error


def _expert_weight(projection, expert: int) -> Tensor:
    """Expert ``expert``'s effective weight ``(out, in)`` from an SKStackedLinear (one expert at a
    time, so no dense copy of the whole stack is made)."""
    dtype = projection.S1.dtype
    product = projection.S1[expert] @ projection.U1[expert].to(dtype) + projection.U2[expert].to(dtype) @ projection.S2[expert]
    return (projection.scale * product).t().detach()


def _weight_terms(part, projection) -> Terms:
    """Per expert ``(‖Ŵ_e − W_e‖², ‖W_e‖²)``."""
    terms = []
    for e in range(part.copies):
        weight = part.expert_matrix(e).detach()
        approx = _expert_weight(projection, e).to(weight.dtype)
        terms.append((float((approx - weight).double().square().sum()), float(weight.double().square().sum())))
    return terms


def _ratio(terms: Terms) -> float:
    return error_ratio(sum(n for n, _ in terms), sum(d for _, d in terms))


def _part_fit(
    part, projection, new, recorder: Optional[ExpertsRecorder], init: str, strengths: Optional[List[Optional[float]]]
) -> Tuple[FitResult, Terms, Terms]:
    """The report's figures of one projection, with the per-expert columns (``strengths``: each
    expert's shrinkage, None without a whitened fit), and the per-expert ``(numerator,
    denominator)`` terms of its weight and output errors."""
    weight_terms = _weight_terms(part, projection)
    output_terms = []
    if recorder is not None:
        gram_stack = recorder.grams[part.projection]
        output_terms = [
            output_error_terms(part.expert_matrix(e), _expert_weight(projection, e), gram_stack[e])
            for e in range(part.copies)
        ]
    counts = projection.parameter_counts()
    extra = dict(
        experts=part.copies,
        expert_rows=None if recorder is None else list(recorder.expert_rows),
        expert_weight_errors=[error_ratio(*terms) for terms in weight_terms],
        expert_output_errors=[error_ratio(*terms) for terms in output_terms] or None,
        data_free_experts=None if recorder is None else recorder.data_free(part),
        expert_shrinkage=strengths,
    )
    shared = {strength for strength in strengths or () if strength is not None}
    fit = FitResult(
        module=new, init=init, trainable_params=counts.trainable, stored_params=counts.stored,
        weight_error=_ratio(weight_terms), output_error=_ratio(output_terms) if output_terms else math.nan,
        calibration_rows=None if recorder is None else recorder.rows,
        shrinkage=shared.pop() if len(shared) == 1 else math.nan, extra=extra,
    )
    return fit, weight_terms, output_terms


def _note_data_free(part, free: List[int], rows: List[int]) -> None:
    if free:
        seen = ", ".join(f"{e}: {rows[e]}" for e in free[:8]) + (", ..." if len(free) > 8 else "")
        part.notes = (
            f"experts {free} received fewer calibration rows than the {part.fan_in} inputs of {part.projection} "
            f"(rows {seen}): fitted to their weights alone (data-free)"
        )


def fit_experts(
    record, recorder: Optional[ExpertsRecorder], init: str, seed: Optional[int], fit: str, shrinkage="auto"
) -> FitResult:
    """The SKExperts of ``record`` at its parts' planned sizes (see the module docstring), each
    expert's Gram shrunk as ``shrinkage`` says (:meth:`ExpertsRecorder.strengths`); a
    recorder no batch reached fits every expert to its weights with a warning."""
    calibrated = recorder is not None and recorder.rows > 0
    if recorder is not None and not calibrated:
        warn_uncalibrated(record)
    if calibrated:
        recorder.check_finite()
        if recorder.unaligned:
            record.note(UNALIGNED_NOTE)
    grams = recorder.fit_grams(shrinkage) if calibrated and init == "svd" else None
    sizes = record.sizes
    new = check_built(record, record.kind.build(record.module, *next(iter(sizes.values())), sizes=sizes, init=init,
                                               seed=seed, gram=grams, fit=fit))
    record.kind.match_trainability(new, record.module)
    label = "calibrated" if grams is not None else init
    parts: Dict[str, FitResult] = {}
    weights: Terms = []
    outputs: Terms = []
    for part, projection in zip(record.parts, new.projections()):
        strengths = recorder.strengths(part, shrinkage) if grams is not None else None
        found = _part_fit(part, projection, new, recorder if calibrated else None, label, strengths)
        parts[part.name], weight_terms, output_terms = found
        weights, outputs = weights + weight_terms, outputs + output_terms
        if grams is not None:
            _note_data_free(part, recorder.data_free(part), recorder.expert_rows)
    return FitResult(
        module=new, init=label,
        trainable_params=sum(fit.trainable_params for fit in parts.values()),
        stored_params=sum(fit.stored_params for fit in parts.values()),
        weight_error=_ratio(weights), output_error=_ratio(outputs) if outputs else math.nan,
        calibration_rows=recorder.rows if calibrated else None, parts=parts,
    )


@torch.no_grad()
def measure_weights(record, fit: FitResult) -> None:
    """Measure ``fit``'s weight errors again (the module's, each projection's and each expert's)
    after its factors were trained further."""
    every = []
    for part, projection in zip(record.parts, fit.module.projections()):
        terms = _weight_terms(part, projection)
        part_fit = fit.parts[part.name]
        part_fit.weight_error = _ratio(terms)
        part_fit.extra["expert_weight_errors"] = [error_ratio(*t) for t in terms]
        part_fit.init = f"{part_fit.init}+refined"
        every += terms
    fit.weight_error = _ratio(every)
