"""Fitting: build the sketched replacement of one planned layer from its weight and, with
calibration, its input Gram (layer ``i`` of a plan with the seed :func:`layer_seed` gives it);
measure how far it is from the dense layer."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch.nn as nn
from torch import Tensor

from ...nn.low_rank_fit import relative_error, row_slices
from ..records import LayerRecord


def layer_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of the fit of layer ``index`` of a plan: ``seed + index`` (None stays None).

    Examples:
        >>> layer_seed(7, 2), layer_seed(None, 2)
        (9, None)
    """
    return None if seed is None else seed + index


@dataclass
class FitResult:
    """A fitted replacement and the report's figures for it: ``calibration_rows``, the real
    (unpadded) calibration rows it was fitted on (None without calibration), ``shrinkage``,
    the strength its whitening Gram was shrunk by (NaN when no Gram whitened the fit). A layer
    of several weight stacks (a mixture-of-experts module) has a FitResult per part in
    ``parts`` (by part name, with ``module`` the whole layer), each with its own report
    columns in ``extra``."""

    module: nn.Module
    init: str
    trainable_params: int
    stored_params: int
    weight_error: float
    output_error: float
    calibration_rows: Optional[int] = None
    shrinkage: float = math.nan
    parts: Dict[str, "FitResult"] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)


def output_error_terms(weight: Tensor, approx: Tensor, gram: Tensor) -> Tuple[float, float]:
    """``(trace((W−Ŵ) G (W−Ŵ)ᵀ), trace(W G Wᵀ))``, with W, Ŵ as (fan_out, fan_in), summed a few
    rows at a time in the Gram's dtype (no full float64 copy of a large weight)."""
    weight = weight.detach().reshape(weight.shape[0], -1)
    approx = approx.detach().reshape_as(weight)
    numerator = denominator = gram.new_zeros(())
    for rows in row_slices(*weight.shape):
        w = weight[rows].to(gram)
        diff = w - approx[rows].to(gram)
        numerator = numerator + ((diff @ gram) * diff).sum()
        denominator = denominator + ((w @ gram) * w).sum()
    return float(numerator), float(denominator)


def error_ratio(numerator: float, denominator: float) -> float:
    """``sqrt(numerator / denominator)`` (NaN when the denominator is not positive)."""
    return math.sqrt(max(numerator / denominator, 0.0)) if denominator > 0 else math.nan


def output_error(weight: Tensor, approx: Tensor, gram: Tensor) -> float:
    """``‖X(W−Ŵ)ᵀ‖_F / ‖XWᵀ‖_F`` from the Gram ``G = XᵀX``:
    ``sqrt(trace((W−Ŵ) G (W−Ŵ)ᵀ) / trace(W G Wᵀ))`` (:func:`output_error_terms`)."""
    return error_ratio(*output_error_terms(weight, approx, gram))


def check_built(record: LayerRecord, new) -> nn.Module:
    """``new`` if it is what ``record``'s kind says its ``build`` makes (its ``built_type``);
    TypeError naming the kind and the layer otherwise (a user kind's bug, e.g. a build returning None)."""
    kind = record.kind
    if not isinstance(new, kind.built_type):
        raise TypeError(
            f"layer kind {kind.name!r}: build() returned {type(new).__name__} for layer {record.name!r}, expected a "
            f"{kind.built_type.__name__} (the kind's built_type): fix the kind's build"
        )
    return new


def built_weight(record: LayerRecord, new: nn.Module, weight: Tensor) -> Tensor:
    """The effective weight of the layer ``new`` built for ``record``, shaped as its dense
    ``weight``; ValueError naming the kind and the layer when it has another size."""
    approx = new.effective_weight().detach()
    if approx.numel() != weight.numel():
        raise ValueError(
            f"layer kind {record.kind.name!r}: build() made a layer of weight shape {tuple(approx.shape)} for layer "
            f"{record.name!r}, whose weight is {tuple(weight.shape)}: fix the kind's build"
        )
    return approx.reshape_as(weight)


def fit_layer(
    record: LayerRecord,
    init: str,
    gram: Optional[Tensor],
    seed: Optional[int],
    fit: str = "auto",
    fit_gram: Optional[Tensor] = None,
    whiten: bool = True,
) -> FitResult:
    """The sketched layer of ``record``'s planned size. ``init="svd"`` with a ``gram`` fits
    the outputs on the calibration data (``"calibrated"`` in the report), whitened by
    ``fit_gram`` when given (a regularised ``gram``,
    :mod:`~panther_lite.conversion.calibration.shrinkage`); ``output_error`` is
    measured on ``gram`` itself, which is all it feeds for ``init="sketch"``. ``fit`` picks
    the decomposition (``"auto"``, ``"exact"`` or ``"randomized"``, see
    :mod:`panther_lite.nn.low_rank_fit`). ``whiten=False`` fits the weight alone (data-free)
    while ``gram`` still measures the output error. A calibrated fit of a record with an
    ``output_gram`` weighs its output error by it
    (:meth:`~panther_lite.nn.layer_base.SketchedLayer.initialize_from_weight`)."""
    if fit_gram is None:
        fit_gram = gram
    fit_gram = fit_gram if init == "svd" and gram is not None and whiten else None
    weighted = fit_gram is not None and record.output_gram is not None
    new = check_built(record, record.kind.build(
        record.module, record.num_terms, record.low_rank, init="sketch" if weighted else init, seed=seed,
        gram=None if weighted else fit_gram, fit=fit,
    ))
    record.kind.match_trainability(new, record.module)
    weight = record.weight_matrix().detach()
    if weighted:
        new.initialize_from_weight(weight.reshape(new.dense_weight_shape), "svd", fit_gram, fit=fit,
                                   output_gram=record.output_gram)
    approx = built_weight(record, new, weight)
    counts = new.parameter_counts()
    return FitResult(
        module=new,
        init="calibrated" if fit_gram is not None else init,
        trainable_params=counts.trainable,
        stored_params=counts.stored,
        weight_error=relative_error(approx, weight),
        output_error=math.nan if gram is None else output_error(weight, approx, gram),
    )
