"""``convert(refine=...)``: the block pipeline's ``after_fit`` hook that refines each fitted
block's sketched layers (:func:`~panther_lite.conversion.refinement.refine_block`) and
records, per block, the output error before and after."""
from __future__ import annotations

import contextlib
from dataclasses import asdict
from typing import Iterator, List

import torch.nn as nn

from .block_pipeline import FittedBlock
from .kinds import SKETCHED_TYPES
from .refinement import refine_block

__all__ = ["BlockRefiner", "REFINEMENT_COLUMNS"]

REFINEMENT_COLUMNS = ("block", "name", "error_before", "error_after", "steps", "stopped_early")


@contextlib.contextmanager
def _only_these_train(block: nn.Module, parameters: List[nn.Parameter]) -> Iterator[None]:
    """``block`` in eval mode (no dropout) with every parameter outside ``parameters``
    frozen, so gradients reach only the refined ones; flags restored afterwards."""
    chosen = {id(parameter) for parameter in parameters}
    others = [p for p in block.parameters() if id(p) not in chosen and p.requires_grad]
    training = {module: module.training for module in block.modules()}
    block.eval()
    for parameter in others:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in others:
            parameter.requires_grad_(True)
        for module, flag in training.items():
            module.training = flag


class BlockRefiner:
    """Called with each :class:`~panther_lite.conversion.block_pipeline.FittedBlock`: Adam on
    the factors and biases of the block's sketched layers so that the converted block
    reproduces the original block's outputs on the cached calls (early stopping on held-back
    calls). ``results``: one dict per refined block (``REFINEMENT_COLUMNS``); a block with no
    sketched layer is not refined."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.results: List[dict] = []

    def __call__(self, fitted: FittedBlock) -> None:
        parameters = [
            parameter
            for module in fitted.block.modules() if isinstance(module, SKETCHED_TYPES)
            for parameter in module.parameters(recurse=False)
        ]
        if not parameters:
            return
        with _only_these_train(fitted.block, parameters):
            result = refine_block(parameters, fitted.predict, fitted.targets, progress=False, **self.settings)
        self.results.append({"block": fitted.index, "name": fitted.name, **asdict(result)})
