"""Fitting a planned list of layers: each from its calibration Gram (or its weight alone), or
sequentially against the original layers' outputs; layers the data never reached are fitted
to their weights with a warning."""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch.nn as nn

from .calibration import Calibration
from .fitting import FitResult, fit_layer
from .layer_record import LayerRecord
from .progress import progress_bar
from .sequential import fit_sequentially
from .shrinkage import note_few_rows, shrinkage_intensity


def warn_uncalibrated(record: LayerRecord) -> None:
    record.reason = "calibration data never reached this layer; fitted to the weight alone"
    warnings.warn(
        f"convert: calibration data never reached {record.name!r}; fitted to its weight alone", UserWarning, stacklevel=5
    )


def fit_all(
    todo: List[LayerRecord], init: str, calibration: Optional[Calibration], seed: Optional[int], progress, fit: str
) -> Dict[str, FitResult]:
    """Fit every planned layer (layer ``i`` of the plan draws its sketches from ``seed + i``),
    releasing each Gram as soon as the last layer using it is fitted."""
    fits = {}
    for index, record in enumerate(progress_bar(todo, "converting", "layer", progress)):
        recorder = None if calibration is None else calibration.recorders.get(record.name)
        gram = None if recorder is None else recorder.finite_gram()
        if recorder is not None and gram is None:
            warn_uncalibrated(record)
        fit_gram = None if gram is None else recorder.fit_gram()
        if fit_gram is not None:
            note_few_rows(record, recorder.moments, shrinkage_intensity(gram, recorder.moments))
        fits[record.name] = fit_layer(record, init, gram, None if seed is None else seed + index, fit, fit_gram)
        if calibration is not None:
            calibration.release(record.name)
    return fits


def fit_planned(
    model: nn.Module,
    todo: List[LayerRecord],
    calibration: Optional[Calibration],
    options: dict,
    batches=None,
    converted_batches=None,
    prefitted: Optional[Dict[str, nn.Module]] = None,
) -> Dict[str, FitResult]:
    """Fit ``todo`` as ``options`` (convert's) ask: from ``calibration``'s Grams, or with
    ``sequential`` on ``batches`` (default: the calibration data; the partly converted model
    runs on ``converted_batches``, default the same, with the ``prefitted`` modules swapped in).
    Layer ``i`` uses ``options["seed"] + i``."""
    if not options["sequential"]:
        return fit_all(todo, options["init"], calibration, options["seed"], options["progress"], options["fit"])
    fits, unreached = fit_sequentially(
        model, todo, options["calibration_data"] if batches is None else batches, seed=options["seed"],
        device=options["calibration_device"], progress=options["progress"], fit=options["fit"],
        converted_batches=converted_batches, prefitted=prefitted,
    )
    for record in unreached:
        warn_uncalibrated(record)
        seed = None if options["seed"] is None else options["seed"] + todo.index(record)
        fits[record.name] = fit_layer(record, "svd", None, seed, options["fit"])
    return fits
