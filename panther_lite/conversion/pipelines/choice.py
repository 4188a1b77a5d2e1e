"""Choosing the pipeline: one function holding every rule for when a conversion runs block by
block and, when it does not, the reason it reports."""
from __future__ import annotations

from typing import Union

from .base import Conversion
from .blocks import chain_problem, find_blocks
from .by_blocks import ByBlocks
from .whole_model import WholeModel

__all__ = ["choose_pipeline"]


def choose_pipeline(job: Conversion) -> Union[ByBlocks, WholeModel]:
    """The pipeline ``job`` runs on, its ``description`` saying why: :class:`ByBlocks` when the
    model has a block list (``blocks``: found, or the dotted path given) and the calibration data
    is a non-empty list of batches the blocks run on one after the other, else
    :class:`WholeModel`. A ``blocks`` path that names no block list, or whose blocks are not a
    chain, is a ValueError; so is ``refine`` (which refines block by block) on the whole model."""
    config, data = job.config, job.data
    block_list, description = find_blocks(job.model, job.records, config.blocks)
    first = data.first_batch() if block_list is not None and data.reiterable else None
    if block_list is not None:
        if not data.given:
            block_list, description = None, "no calibration data, so nothing runs block by block"
        elif not data.reiterable:
            block_list, description = None, "calibration_data is a callable or a one-shot iterator, not a list of batches"
        elif first is None:
            block_list, description = None, "calibration_data holds no batch"
        else:
            problem = chain_problem(job.model, block_list, first)
            if problem is not None and config.blocks not in (None, "auto"):
                raise ValueError(f"blocks={config.blocks!r}: {problem}; pass blocks=False")
            if problem is not None:
                block_list, description = None, problem
    if block_list is not None:
        return ByBlocks(block_list, f"{ByBlocks.name}: {description}", config)
    pipeline = WholeModel(description)
    if config.refine is not None:
        raise ValueError(f"refine refines block by block, but this convert runs on the {pipeline.description}")
    return pipeline
