"""The pipeline seam: :class:`Conversion`, one conversion under way, and :class:`Pipeline`, the
protocol its named implementations (whole model, by blocks, ...) follow: plan the sizes, fit
and swap, and say what runs the converted model once for the check."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Tuple

import torch.nn as nn

from ..calibration.batches import CalibrationData, ModelRun
from ..config import ConvertConfig
from ..fitting.layer import FitResult
from ..planning.sizes import PlanNote
from ..records import LayerRecord
from ..surgery import SwapLog

__all__ = ["Conversion", "Pipeline"]


@dataclass
class Conversion:
    """One conversion under way: the model, its validated config and calibration data, and a
    record per selected layer (planners and fits update the records in place)."""

    model: nn.Module
    config: ConvertConfig
    data: CalibrationData
    records: List[LayerRecord]

    @property
    def todo(self) -> List[LayerRecord]:
        """The records still to convert, in model order (the plan's layer ``i`` is ``todo[i]``)."""
        return [record for record in self.records if record.to_convert]


class Pipeline(Protocol):
    """How a conversion is carried out, in three steps that :func:`~panther_lite.conversion.workflows.convert.run_pipeline`
    calls in order (nothing in the model changes before :meth:`fit`, which swaps all or nothing).

    ``description``: ``"<name>: <why or what>"``, the report's ``attrs["pipeline"]``.
    """

    name: str
    description: str

    def plan(self, job: Conversion) -> Dict[str, PlanNote]:
        """Size every record (``num_terms``/``low_rank``, or kept dense with the reason) and
        gather what the fits need; returns the planner's notes per layer."""

    def fit(self, job: Conversion) -> Tuple[Dict[str, FitResult], SwapLog]:
        """Fit ``job.todo`` and swap the fitted layers in; returns the fits and the swap log
        (on error, every swap is undone before raising)."""

    def replay(self, job: Conversion) -> Optional[ModelRun]:
        """What runs the converted model once when no ``example_inputs`` are given (None: no run)."""

    def report_attrs(self) -> dict:
        """Extra ``attrs`` of the report (e.g. ``refinement``)."""
