"""Fitting a planned list of layers as the config asks: each from its calibration Gram (or its
weight alone), or sequentially against the original layers' outputs; layers the data never
reached are fitted to their weights with a warning."""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional

import torch.nn as nn

from ..calibration.grams import Calibration, GramRecorder
from ..calibration.shrinkage import note_calibration, shrink
from ..calibration.tokens import UNALIGNED_NOTE
from ..config import ConvertConfig
from ..records import LayerRecord
from ..progress import progress_bar
from .across import fit_split
from .layer import FitResult, fit_layer, layer_seed
from .sequential import fit_sequentially


def warn_uncalibrated(record: LayerRecord) -> None:
    record.note("calibration data never reached this layer; fitted to the weight alone")
    warnings.warn(
        f"convert: calibration data never reached {record.name!r}; fitted to its weight alone", UserWarning, stacklevel=5
    )


def fit_from_gram(
    record: LayerRecord, recorder: Optional[GramRecorder], init: str, seed: Optional[int], fit: str, shrinkage="auto"
) -> FitResult:
    """The fit of a one-matrix layer from its Gram recorder (None: from its weight alone; a
    recorder no batch reached: the same, with a warning), its Gram shrunk as ``shrinkage``
    (the config's option) says for a fit at the layer's rank (the report says so when its
    real rows are fewer than its inputs). A routed expert that received fewer rows than it has
    inputs is fitted to its weight alone (data-free)."""
    gram = None if recorder is None else recorder.finite_gram()
    if recorder is not None and gram is None:
        warn_uncalibrated(record)
    if gram is None:
        return fit_layer(record, init, gram, seed, fit)
    strength = fit_gram = None
    if record.routed and recorder.rows < record.fan_in:
        record.note(
            f"routed expert: received {recorder.rows} calibration rows, fewer than its {record.fan_in} inputs: "
            "fitted to its weight alone (data-free)"
        )
        result = fit_layer(record, init, gram, seed, fit, whiten=False)
    else:
        if init == "svd":
            strength = recorder.strength(shrinkage, record, record.rank)
            fit_gram = shrink(gram, strength) if strength else gram
        note_calibration(record, recorder.rows, strength or 0.0, setting=shrinkage if init == "svd" else 0.0)
        result = fit_layer(record, init, gram, seed, fit, fit_gram)
    if recorder.unaligned:
        record.note(UNALIGNED_NOTE)
    result.calibration_rows = recorder.rows
    result.shrinkage = math.nan if strength is None else strength
    return result


def fit_all(
    todo: List[LayerRecord], config: ConvertConfig, calibration: Optional[Calibration], first_index: int = 0,
    progress: Optional[bool] = False,
) -> Dict[str, FitResult]:
    """Fit every planned layer from its statistics, as its kind does, shrunk as
    ``config.shrinkage`` says (layer ``i`` of ``todo`` is layer ``first_index + i`` of the
    plan, for its seed), releasing each Gram as soon as the last layer using it is fitted. Across
    processes each layer is fitted by one rank and sent to the others
    (:func:`~panther_lite.conversion.fitting.across.fit_split`)."""

    def fit_one(index: int, record: LayerRecord) -> FitResult:
        recorder = None if calibration is None else calibration.recorders.get(record.name)
        seed = layer_seed(config.seed, first_index + index)
        return record.strategy.fit(record, recorder, config.init, seed, config.decomposition, config.shrinkage)

    release = None if calibration is None else (lambda record: calibration.release(record.name))
    return fit_split(todo, fit_one, release, lambda records: progress_bar(records, "converting", "layer", progress))


def fit_planned(
    model: nn.Module,
    todo: List[LayerRecord],
    config: ConvertConfig,
    calibration: Optional[Calibration],
    batches=None,
    *,
    first_index: int = 0,
    progress: Optional[bool] = False,
    converted_batches=None,
    prefitted: Optional[Dict[str, nn.Module]] = None,
) -> Dict[str, FitResult]:
    """Fit ``todo`` as ``config`` asks: from ``calibration``'s Grams, or with ``sequential`` on
    ``batches`` (the calibration data; the partly converted model runs on ``converted_batches``,
    default the same, with the ``prefitted`` modules swapped in). Layer ``i`` of ``todo`` is
    layer ``first_index + i`` of the plan (:func:`~panther_lite.conversion.fitting.layer.layer_seed`);
    ``progress`` shows bars (default: none)."""
    if not config.sequential:
        return fit_all(todo, config, calibration, first_index, progress)
    fits, unreached = fit_sequentially(
        model, todo, batches, seed=layer_seed(config.seed, first_index), device=config.calibration_device,
        progress=progress, fit=config.decomposition, converted_batches=converted_batches, prefitted=prefitted,
        shrinkage=config.shrinkage,
    )

    def fit_unreached(index: int, record: LayerRecord) -> FitResult:
        warn_uncalibrated(record)
        seed = layer_seed(config.seed, first_index + todo.index(record))
        return record.strategy.fit(record, None, "svd", seed, config.decomposition)

    fits.update(fit_split(unreached, fit_unreached))
    return fits
