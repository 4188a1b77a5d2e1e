"""Fitting a planned list of layers as the config asks: each from its calibration Gram (or its
weight alone), or sequentially against the original layers' outputs; layers the data never
reached are fitted to their weights with a warning."""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional

import torch.nn as nn

from ..calibration.grams import Calibration
from ..calibration.shrinkage import note_calibration, shrink
from ..config import ConvertConfig
from ..records import LayerRecord
from ..rules import layer_seed, progress_bar
from .layer import FitResult, fit_layer
from .sequential import fit_sequentially


def warn_uncalibrated(record: LayerRecord) -> None:
    record.reason = "calibration data never reached this layer; fitted to the weight alone"
    warnings.warn(
        f"convert: calibration data never reached {record.name!r}; fitted to its weight alone", UserWarning, stacklevel=5
    )


def fit_all(
    todo: List[LayerRecord], config: ConvertConfig, calibration: Optional[Calibration], first_index: int = 0,
    progress: Optional[bool] = False,
) -> Dict[str, FitResult]:
    """Fit every planned layer from its Gram, shrunk as ``config.shrinkage`` says (layer ``i``
    of ``todo`` is layer ``first_index + i`` of the plan, for its seed), releasing each Gram as
    soon as the last layer using it is fitted."""
    fits = {}
    for index, record in enumerate(progress_bar(todo, "converting", "layer", progress)):
        recorder = None if calibration is None else calibration.recorders.get(record.name)
        gram = None if recorder is None else recorder.finite_gram()
        if recorder is not None and gram is None:
            warn_uncalibrated(record)
        seed = layer_seed(config.seed, first_index + index)
        strength = fit_gram = None
        if gram is not None and config.init == "svd":
            strength = recorder.strength(config.shrinkage, record, record.rank)
            fit_gram = shrink(gram, strength) if strength else gram
        if gram is not None:
            note_calibration(record, recorder.rows, 0.0 if strength is None else strength, recorder.unaligned)
        fits[record.name] = fit = fit_layer(record, config.init, gram, seed, config.fit, fit_gram)
        if gram is not None:
            fit.calibration_rows = recorder.rows
            fit.shrinkage = math.nan if strength is None else strength
        if calibration is not None:
            calibration.release(record.name)
    return fits


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
    layer ``first_index + i`` of the plan (:func:`~panther_lite.conversion.rules.layer_seed`);
    ``progress`` shows bars (default: none)."""
    if not config.sequential:
        return fit_all(todo, config, calibration, first_index, progress)
    fits, unreached = fit_sequentially(
        model, todo, batches, seed=layer_seed(config.seed, first_index), device=config.calibration_device,
        progress=progress, fit=config.fit, converted_batches=converted_batches, prefitted=prefitted,
        shrinkage=config.shrinkage,
    )
    for record in unreached:
        warn_uncalibrated(record)
        seed = layer_seed(config.seed, first_index + todo.index(record))
        fits[record.name] = fit_layer(record, "svd", None, seed, config.fit)
    return fits
