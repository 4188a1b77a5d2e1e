"""Layer strategies: how convert calibrates, sizes and fits the layers of a kind — the upper half
of a layer kind, beside its description (:class:`~panther_lite.conversion.kinds.LayerKind`, which
names its strategy in ``strategy``).

A strategy is handed to each record when it is made (:func:`new_record`), so the stages that
call it (calibration, planning, fitting) read it from the record and never import it.
:class:`MatrixStrategy` serves every kind holding one weight matrix (the Gram of its inputs, a
whitened fit); :class:`ExpertsStrategy` a mixture of experts' weight stacks (per-expert Grams of
the rows the router sends each expert).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.low_rank_fit import relative_error
from ..calibration.experts import ExpertsRecorder
from ..calibration.grams import GramRecorder, spectrum_gram
from ..fitting.experts import fit_experts, measure_weights
from ..fitting.layer import FitResult
from ..fitting.planned import fit_from_gram
from ..planning.allocation import expert_energies, whitened_energy
from ..records import LayerRecord

__all__ = ["LayerStrategy", "MatrixStrategy", "ExpertsStrategy", "STRATEGIES", "new_record"]


class LayerStrategy(ABC):
    """How the layers of a kind are calibrated (:meth:`recorder`), sized by a global plan
    (:meth:`energies`) and fitted (:meth:`fit`, :meth:`refresh_weight_error`). Every method is
    required; a record's kind gives the layer's tensors and shapes."""

    # ------------------------------------------------------------------ calibration
    @abstractmethod
    def recorder(self, record: LayerRecord, device: Optional[torch.device], held_back: bool = False):
        """The forward pre-hook (``with_kwargs=True``) accumulating the layer's calibration
        statistics on ``device`` from the batches' real tokens, with held-back statistics when
        ``held_back`` (for ``shrinkage="auto"``). It has ``record``, ``rows`` (0: no batch
        reached the layer), ``last_input`` and ``statistics()`` (the tensors checked finite after
        each batch)."""

    # ------------------------------------------------------------------ planning
    @abstractmethod
    def energies(self, record: LayerRecord, recorder, config=None) -> Dict[str, Tensor]:
        """``{part name: squared singular values}`` of each part's whitened weight (the global
        allocation's spectra; weighted by the record's ``output_gram`` when it holds one) from
        ``recorder`` (None, or no rows: the weight's own spectrum), its statistics shrunk as the
        :class:`~panther_lite.conversion.ConvertConfig` ``config`` says (needed with a recorder)."""

    # ------------------------------------------------------------------ fitting
    @abstractmethod
    def fit(
        self, record: LayerRecord, recorder, init: str, seed: Optional[int], fit: str, shrinkage="auto"
    ) -> FitResult:
        """The fitted sketched layer of ``record`` at its planned size from its ``recorder``
        (None: from the weight alone), its statistics shrunk as ``shrinkage`` (the config's
        option) says, with the report's figures."""

    @abstractmethod
    def refresh_weight_error(self, record: LayerRecord, fit: FitResult) -> None:
        """Measure ``fit``'s weight errors again against ``record``'s dense weights (its sketched
        layer was trained further)."""


class MatrixStrategy(LayerStrategy):
    """One weight matrix: the input Gram (:class:`~panther_lite.conversion.calibration.grams.GramRecorder`),
    its whitened spectrum (:func:`~panther_lite.conversion.planning.allocation.whitened_energy`)
    and the whitened fit (:func:`~panther_lite.conversion.fitting.planned.fit_from_gram`)."""

    def recorder(self, record: LayerRecord, device: Optional[torch.device], held_back: bool = False) -> GramRecorder:
        return GramRecorder(record, device, held_back)

    def energies(self, record: LayerRecord, recorder, config=None) -> Dict[str, Tensor]:
        gram = spectrum_gram(recorder, record, config)
        return {record.name: whitened_energy(record.weight_matrix(), gram, output_gram=record.output_gram)}

    def fit(self, record: LayerRecord, recorder, init: str, seed: Optional[int], fit: str, shrinkage="auto") -> FitResult:
        return fit_from_gram(record, recorder, init, seed, fit, shrinkage)

    def refresh_weight_error(self, record: LayerRecord, fit: FitResult) -> None:
        """``‖Ŵ − W‖_F / ‖W‖_F`` again."""
        weight = record.weight_matrix().detach()
        fit.weight_error = relative_error(fit.module.effective_weight().detach().reshape_as(weight), weight)


class ExpertsStrategy(LayerStrategy):
    """Stacks of experts' matrices (:mod:`~panther_lite.conversion.calibration.experts`,
    :mod:`~panther_lite.conversion.fitting.experts`): the recorder keeps no held-back half,
    ``shrinkage="auto"`` shrinks each expert by its Ledoit–Wolf ``α``."""

    def recorder(self, record: LayerRecord, device: Optional[torch.device], held_back: bool = False) -> ExpertsRecorder:
        return ExpertsRecorder(record, device)

    def energies(self, record: LayerRecord, recorder, config=None) -> Dict[str, Tensor]:
        return expert_energies(record, recorder, "auto" if config is None else config.shrinkage)

    def fit(self, record: LayerRecord, recorder, init: str, seed: Optional[int], fit: str, shrinkage="auto") -> FitResult:
        return fit_experts(record, recorder, init, seed, fit, shrinkage)

    def refresh_weight_error(self, record: LayerRecord, fit: FitResult) -> None:
        measure_weights(record, fit)


STRATEGIES: Dict[str, LayerStrategy] = {"matrix": MatrixStrategy(), "experts": ExpertsStrategy()}


def new_record(kind, name: str, module: nn.Module) -> LayerRecord:
    """The conversion record of candidate ``module`` named ``name`` of ``kind``, holding the
    strategy the kind names.

    Examples:
        >>> import torch.nn as nn
        >>> from panther_lite.conversion.kinds import LINEAR
        >>> record = new_record(LINEAR, "fc", nn.Linear(4, 3))
        >>> type(record.strategy).__name__, record.fan_in, record.fan_out
        ('MatrixStrategy', 4, 3)
    """
    record = kind.record(name, module)
    record.strategy = STRATEGIES[kind.strategy]
    return record
