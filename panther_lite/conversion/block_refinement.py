"""``convert(refine=...)``: its settings, and the block pipeline's ``after_fit`` hook that
refines the layers each block just got (:func:`~panther_lite.conversion.refinement.refine_block`)
and records, per block, the output error before and after."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Iterator, List, Mapping, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..nn.low_rank_fit import relative_error
from ..nn.validation import check_positive_int
from .block_pipeline import FittedBlock
from .refinement import check_holdout, check_lr, refine_block

__all__ = ["BlockRefiner", "REFINEMENT_COLUMNS", "REFINE_SETTINGS", "check_refine", "only_these_train"]

REFINE_SETTINGS = ("max_steps", "lr", "holdout", "patience")
REFINEMENT_COLUMNS = ("block", "name", "error_before", "error_after", "steps", "stopped_early")
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_refine(refine) -> Optional[dict]:
    """``convert``'s ``refine`` argument as :func:`refine_block` keyword arguments: None for
    off (False / None), ``{}`` for the defaults (True or an empty dict), else the validated
    mapping (TypeError / ValueError naming the setting)."""
    if refine is None or refine is False:
        return None
    if refine is True:
        return {}
    if not isinstance(refine, Mapping):
        raise TypeError(
            f"refine must be True, False or a dict of refine_block settings {REFINE_SETTINGS}, got {type(refine).__name__}"
        )
    unknown = sorted(str(key) for key in refine if key not in REFINE_SETTINGS)
    if unknown:
        raise ValueError(f"refine: unknown setting(s) {unknown}; expected some of {REFINE_SETTINGS}")
    settings = dict(refine)
    for name in ("max_steps", "patience"):
        if name in settings:
            settings[name] = check_positive_int(f"refine[{name!r}]", settings[name])
    if "lr" in settings:
        settings["lr"] = check_lr(settings["lr"], "refine: ")
    if "holdout" in settings:
        settings["holdout"] = check_holdout(settings["holdout"], "refine: ")
    return settings


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


@contextlib.contextmanager
def _in_float32(block: nn.Module) -> Iterator[bool]:
    """``block``'s float16/bfloat16 parameters and buffers held in float32 for the duration
    (Adam's moments and small updates need it), then rounded back; yields whether any was."""
    low = [t for t in itertools.chain(block.parameters(), block.buffers()) if t.dtype in _HALF_DTYPES]
    dtypes = [t.dtype for t in low]
    for tensor in low:
        tensor.data = tensor.data.float()
    try:
        yield bool(low)
    finally:
        for tensor, dtype in zip(low, dtypes):
            tensor.data = tensor.data.to(dtype)


def _float32_calls(fitted: FittedBlock) -> FittedBlock:
    """``fitted`` with the half-precision tensors of its cached calls in float32."""
    widen = lambda value: value.float() if isinstance(value, torch.Tensor) and value.dtype in _HALF_DTYPES else value
    return dataclasses.replace(fitted, calls=[tree_map(widen, call) for call in fitted.calls])


class BlockRefiner:
    """Called with each :class:`~panther_lite.conversion.block_pipeline.FittedBlock`: Adam on
    the factors and biases of the layers this conversion just fitted in the block (in float32
    for a half-precision block) so that the converted block reproduces the original block's
    outputs on the cached calls, stopping early on held-back calls. A layer it changed reads
    ``init="<fit>+refined"`` in the report with its ``weight_error`` measured again
    (``output_error`` stays the closed-form fit's). ``results``: one dict per refined block
    (``REFINEMENT_COLUMNS``); a block with no new layer is not refined."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.results: List[dict] = []

    def __call__(self, fitted: FittedBlock) -> None:
        parameters = [p for fit in fitted.fits.values() for p in fit.module.parameters()]
        if not parameters:
            return
        with only_these_train(fitted.block, parameters), _in_float32(fitted.block) as widened:
            work = _float32_calls(fitted) if widened else fitted
            result = refine_block(parameters, work.predict, work.targets, progress=False, **self.settings)
        self.results.append({"block": fitted.index, "name": fitted.name, **dataclasses.asdict(result)})
        if result.error_after < result.error_before:
            for record in fitted.records:
                fit = fitted.fits[record.name]
                weight = record.weight_matrix().detach()
                fit.weight_error = relative_error(fit.module.effective_weight().detach().reshape_as(weight), weight)
                fit.init = f"{fit.init}+refined"
