"""The setup step every conversion workflow shares: the options made into one validated config,
the calibration data checked once, then the model's candidate layers selected and marked into
the job a pipeline carries out (:class:`~panther_lite.conversion.pipelines.base.Conversion`)."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch.nn as nn

from ..calibration.batches import CalibrationData
from ..config import ConvertConfig, make_config
from ..pipelines.base import Conversion
from ..planning.output_fisher import check_output_fisher
from ..selection import mark_unconvertible, select_layers

__all__ = ["conversion_options", "conversion_job"]


def conversion_options(
    config: Optional[ConvertConfig], overrides: Mapping[str, object], calibration_data, caller: str = "convert"
) -> Tuple[ConvertConfig, CalibrationData]:
    """``config`` with ``overrides`` (:func:`~panther_lite.conversion.config.make_config`) and the
    calibration data, checked for ``sequential=True`` and ``output_fisher=True`` when the config asks for them."""
    config = make_config(config, overrides, caller=caller)
    data = CalibrationData(calibration_data)
    if config.sequential:
        data.check_sequential()
    if config.output_fisher:
        check_output_fisher(data)
    return config, data


def conversion_job(
    model: nn.Module, config: ConvertConfig, data: CalibrationData, meta_loaded_later: bool = False
) -> Conversion:
    """The job of converting ``model``: its layers selected as ``config`` says and those that cannot
    convert marked (``meta_loaded_later``: weights on the meta device are loaded by the pipeline)."""
    records = select_layers(model, config.target_modules, config.exclude_modules, config.filter_fn)
    mark_unconvertible(model, records, meta_loaded_later=meta_loaded_later)
    return Conversion(model, config, data, records)
