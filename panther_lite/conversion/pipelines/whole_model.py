"""The whole-model pipeline: every selected layer calibrated in one run of the model (or
sequentially, group by group), fitted, then all swapped in at once."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..calibration.batches import ModelRun
from ..calibration.grams import Calibration, collect_grams
from ..fitting.layer import FitResult
from ..fitting.planned import fit_planned
from ..planning.global_plan import plan_global
from ..planning.output_fisher import attach_output_fishers, fisher_importances, fisher_totals, release_fishers
from ..planning.sensitivity import output_gains
from ..planning.sizes import PlanNote, plan_uniform, rank_multiple_for
from ..surgery import SwapLog, swap_modules
from .base import Conversion


class WholeModel:
    """The pipeline calibrating and fitting the whole model at once; ``description`` says why
    it runs (``"whole model: <why>"``)."""

    name = "whole model"

    def __init__(self, reason: str) -> None:
        self.description = f"{self.name}: {reason}"
        self.calibration: Optional[Calibration] = None

    def plan(self, job: Conversion) -> Dict[str, PlanNote]:
        """Size the records (uniformly, or from one global budget read from every pooled
        layer's spectrum), record the Grams the non-sequential fits need and, with
        ``output_fisher``, each layer's output Fisher (measured first: the plan reads it too)."""
        config, model = job.config, job.model
        notes, pooled = plan_uniform(job.records, config)
        candidates = [record for record in job.records if record.to_convert]
        if job.data.given and candidates and (pooled or not config.sequential):
            device = config.calibration_device
            self.calibration = collect_grams(model, candidates, job.data, config.progress, device, config.held_back)
        calibration = self.calibration
        if config.output_fisher:
            attach_output_fishers(model, job.records, job.data, config.seed)
        if pooled:
            recorders = {} if calibration is None else calibration.recorders
            energies = {
                name: energy for r in pooled for name, energy in r.strategy.energies(r, recorders.get(r.name), config).items()
            }
            replay = None if calibration is None else calibration.replay
            gains = {} if replay is None else output_gains(model, pooled, replay, config.sensitivity)
            gains = fisher_importances([r.name for r in pooled], gains, fisher_totals(pooled, energies))
            sizes, multiple_of = config.sizes, rank_multiple_for(config.align)
            notes.update(plan_global(pooled, sizes.default, sizes.ratio_terms, multiple_of, {}, gains, energies))
        if calibration is not None:
            for record in candidates:
                if config.sequential or not record.to_convert:
                    calibration.release(record.name)
        return notes

    def fit(self, job: Conversion) -> Tuple[Dict[str, FitResult], SwapLog]:
        config = job.config
        try:
            fits = fit_planned(job.model, job.todo, config, self.calibration, job.data.source, progress=config.progress)
        finally:
            release_fishers(job.records)
        return fits, swap_modules(job.model, [(name, fit.module) for name, fit in fits.items()])

    def replay(self, job: Conversion) -> Optional[ModelRun]:
        """The calibration run's replay (its first batch, or the user's callable), else (sequential
        fits record no Calibration) the data's own."""
        return self.calibration.replay if self.calibration is not None else job.data.replay()

    def report_attrs(self) -> dict:
        return {}
