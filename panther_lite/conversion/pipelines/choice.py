"""Choosing the pipeline: one function holding every rule for when a conversion runs block by
block and, when it does not, the reason it reports."""
from __future__ import annotations

from typing import Optional, Union

from ..calibration.batches import CalibrationData
from ..process_groups.statistics import first_problem
from .base import Conversion
from .blocks import find_blocks
from .by_blocks import ByBlocks
from .whole_model import WholeModel

__all__ = ["choose_pipeline"]

_NOTHING = object()


def _data_problem(data: CalibrationData) -> Optional[str]:
    """Why the calibration data cannot be replayed block by block, or None."""
    if not data.given:
        return "no calibration data, so nothing runs block by block"
    if not data.reiterable:
        return "calibration_data is a callable or a one-shot iterator, not a list of batches"
    if next(iter(data.source), _NOTHING) is _NOTHING:
        return "calibration_data holds no batch"
    return None


def choose_pipeline(job: Conversion) -> Union[ByBlocks, WholeModel]:
    """The pipeline ``job`` runs on, its ``description`` saying why: :class:`ByBlocks` when the
    model has a block list (``blocks``: found, or the dotted path given), the calibration data
    is a non-empty list of batches, and replaying the blocks one by one on their captured calls
    gives the whole-model result exactly (:meth:`ByBlocks.capture` runs every batch once to
    check it), else :class:`WholeModel` with the reason. A ``blocks`` path that names no block
    list, or whose blocks cannot be replayed exactly, is a ValueError; so is ``refine`` (which
    refines block by block) on the whole model."""
    config = job.config
    block_list, description = find_blocks(job.model, job.records, config.blocks)
    if block_list is not None:
        problem = _data_problem(job.data)
        if problem is None:
            pipeline = ByBlocks(block_list, f"{ByBlocks.name}: {description}", config)
            problem = first_problem(pipeline.capture(job))  # across processes: the same pipeline on every rank
            if problem is None:
                return pipeline
            if config.blocks not in (None, "auto"):
                raise ValueError(f"blocks={config.blocks!r}: {problem}; pass blocks=False")
        description = problem
    pipeline = WholeModel(description)
    if config.refine is not None:
        raise ValueError(f"refine refines block by block, but this convert runs on the {pipeline.description}")
    return pipeline
