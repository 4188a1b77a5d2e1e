"""Refining blocks as they are fitted: :class:`FittedBlock`, what the block pipeline hands its
``after_fit`` hook, and :class:`BlockRefiner`, the hook ``convert(refine=...)`` uses: it refines
the layers each block just got (:func:`~panther_lite.conversion.fitting.refinement.refine_block`)
and records, per block, the output error before and after."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch.nn as nn
from torch import Tensor

from ..calibration.batches import run_batch
from ..calibration.tokens import zero_padding
from ..config import RefineConfig
from ..records import LayerRecord
from .layer import FitResult
from .master_weights import in_float32, widened
from .refinement import refine_block

__all__ = ["FittedBlock", "AfterFit", "BlockRefiner", "REFINEMENT_COLUMNS", "only_these_train"]

REFINEMENT_COLUMNS = ("block", "name", "error_before", "error_after", "steps", "stopped_early")


@dataclass
class FittedBlock:
    """A block just fitted and swapped into the model: where a block-wise refinement hooks in.

    ``index`` / ``name``: the block's place in the block list and its dotted name;
    ``records`` / ``fits``: the layers this conversion just fitted in it and their fits (the
    new modules, already swapped in); ``runner``: the model seen through the block
    (:class:`~panther_lite.conversion.pipelines.blocks.BlockRunner`); ``calls``: the cached
    inputs the converted block receives; ``targets``: the original block's hidden-state
    outputs it should reproduce, one per call (on the original stream's inputs under
    ``sequential=True``, else on ``calls``); ``masks``: the token mask of each call's batch
    (None: every position is data); ``predict(i)``: the converted block's output on
    ``calls[i]`` (with autograd, for refining its parameters)."""

    index: int
    name: str
    block: nn.Module
    runner: nn.Module
    records: List[LayerRecord]
    fits: Dict[str, FitResult]
    calls: List[tuple]
    targets: List[Tensor]
    masks: Optional[List[Optional[Tensor]]] = None

    def predict(self, index: int) -> Tensor:
        output = run_batch(self.runner, self.calls[index])
        return output if isinstance(output, Tensor) else output[0]

    def mask(self, index: int) -> Optional[Tensor]:
        return None if not self.masks else self.masks[index]

    def real_predict(self, index: int) -> Tensor:
        """:meth:`predict` with the padded positions zeroed (they are no data to reproduce)."""
        return zero_padding(self.predict(index), self.mask(index))

    def real_targets(self) -> List[Tensor]:
        """``targets`` with the padded positions zeroed, as :meth:`real_predict`."""
        return [zero_padding(target, self.mask(index)) for index, target in enumerate(self.targets)]


AfterFit = Callable[[FittedBlock], None]


@contextlib.contextmanager
def only_these_train(block: nn.Module, parameters: List[nn.Parameter]) -> Iterator[None]:
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


def _float32_calls(fitted: FittedBlock) -> FittedBlock:
    """``fitted`` with the half-precision tensors of its cached calls in float32."""
    return dataclasses.replace(fitted, calls=[widened(call) for call in fitted.calls])


class BlockRefiner:
    """Called with each :class:`FittedBlock`: Adam on
    the factors and biases of the layers this conversion just fitted in the block (in float32
    for a half-precision block) so that the converted block reproduces the original block's
    outputs on the cached calls (at their real tokens: padded positions count in no loss),
    stopping early on held-back calls. A layer it changed reads
    ``init="<fit>+refined"`` in the report with its ``weight_error`` measured again
    (``output_error`` stays the closed-form fit's). ``results``: one dict per refined block
    (``REFINEMENT_COLUMNS``); a block with no new layer is not refined."""

    def __init__(self, settings: RefineConfig) -> None:
        self.settings = dataclasses.asdict(settings)
        self.results: List[dict] = []

    def __call__(self, fitted: FittedBlock) -> None:
        parameters = [p for fit in fitted.fits.values() for p in fit.module.parameters()]
        if not parameters:
            return
        with only_these_train(fitted.block, parameters), in_float32(fitted.block) as widened:
            work = _float32_calls(fitted) if widened else fitted
            result = refine_block(parameters, work.real_predict, work.real_targets(), progress=False, **self.settings)
        self.results.append({"block": fitted.index, "name": fitted.name, **dataclasses.asdict(result)})
        if result.error_after < result.error_before:
            for record in fitted.records:
                fit = fitted.fits[record.name]
                record.strategy.refresh_weight_error(record, fit)
                fit.init = f"{fit.init}+refined"
