"""The block-by-block conversion pipeline: calibrate, plan, fit and swap a model's repeated
blocks one at a time on cached block inputs, so time grows linearly with depth and memory
holds one block's statistics (plus the cached hidden states).

The first block's inputs are captured once for every calibration batch
(:func:`~panther_lite.conversion.blocks.capture_inputs`). Then per block: its selected layers'
Grams are recorded by running the block alone on the cached calls (the same tensors a whole-model
forward feeds it, so a non-sequential fit is the same as on the whole model), the layers are
fitted and swapped in, and the block is run once on the calls to produce the next block's
inputs: the original block (before the swap), so every Gram comes from the dense model's
activations as when the whole model is calibrated at once. ``sequential=True`` keeps two
streams of calls, the original model's and the partly converted one's (the converted block
feeds it): each layer is fitted to reproduce the original block's outputs from the inputs it
now receives (:mod:`.sequential`).

``allocation="global"`` first makes one *spectra pass* over the dense blocks: each pooled
layer's whitened spectrum (its Gram freed at once) and its gain measured at its block's output
(:func:`~panther_lite.conversion.sensitivity.output_gains` with the block as the model) times
the block's gain to the model's output (one forward and backward of the first batch for all
blocks, :func:`~panther_lite.conversion.sensitivity.block_output_gains`), then
:func:`~panther_lite.conversion.planning.plan_global` sizes every pooled layer, then the fitting
pass runs. Selected layers outside the blocks (``lm_head``, a pooler) are calibrated and fitted
on the whole model afterwards, as without blocks (their gain measured at the model's output).
Any failure undoes every swap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .allocation import whitened_energy
from .blocks import (
    BlockCall, BlockList, BlockRunner, block_device, block_on, chain_problem, find_blocks, hidden_states, run_block,
)  # fmt: skip
from .calibration import collect_grams, reiterable, run_batch
from .fitting import FitResult
from .layer_fits import fit_planned
from .layer_record import LayerRecord
from .planning import PlanNote, SizeRequest, plan_global
from .progress import progress_bar
from .sensitivity import block_output_gains, output_gains
from .surgery import SwapLog, swap_modules, undo_swaps


@dataclass
class FittedBlock:
    """A block just fitted and swapped into the model: where a block-wise refinement hooks in.

    ``index`` / ``name``: the block's place in the block list and its dotted name;
    ``records`` / ``fits``: the layers this conversion just fitted in it and their fits (the
    new modules, already swapped in); ``calls``: the cached inputs the converted block
    receives; ``targets``: the original block's hidden-state outputs it should reproduce, one
    per call (on the original stream's inputs under ``sequential=True``, else on ``calls``);
    ``predict(i)``: the converted block's output on ``calls[i]`` (with autograd, for refining
    its parameters)."""

    index: int
    name: str
    block: nn.Module
    runner: BlockRunner
    records: List[LayerRecord]
    fits: Dict[str, FitResult]
    calls: List[BlockCall]
    targets: List[Tensor]

    def predict(self, index: int) -> Tensor:
        output = run_batch(self.runner, self.calls[index])
        return output if isinstance(output, Tensor) else output[0]


AfterFit = Callable[[FittedBlock], None]


def _cache_device(options: dict) -> torch.device:
    return options["calibration_device"] or torch.device("cpu")


def _spectra(model: nn.Module, pooled: List[LayerRecord], batches, options) -> Tuple[dict, dict]:
    """``({name: whitened spectrum}, {name: squared gain at model's output})`` of ``pooled``
    calibrated on ``batches``; each Gram is freed as soon as its spectrum is taken."""
    calibration = collect_grams(model, pooled, batches, False, options["calibration_device"])
    energies = {}
    for record in pooled:
        recorder = calibration.recorders.get(record.name)
        energies[record.name] = whitened_energy(record.weight_matrix(), None if recorder is None else recorder.fit_gram())
        calibration.release(record.name)
    return energies, output_gains(model, pooled, calibration.replay)


def plan_global_by_blocks(
    model: nn.Module, pooled: List[LayerRecord], block_list: BlockList, calls: List[BlockCall],
    sizes: SizeRequest, multiple_of, options: dict,
) -> Dict[str, PlanNote]:
    """:func:`plan_global` over ``pooled`` from one spectra pass over the dense blocks."""
    last = max((i for i in range(len(block_list.blocks)) if block_list.records_in(i, pooled)), default=-1)
    outside = [record for record in pooled if not block_list.inside(record)]
    energies, gains = _spectra(model, outside, options["calibration_data"], options) if outside else ({}, {})
    first = next(iter(options["calibration_data"]))
    block_gains = block_output_gains(model, block_list.blocks[: last + 1], lambda module: run_batch(module, first))
    blocks = progress_bar(block_list.blocks[: last + 1], "measuring spectra", "block", options["progress"])
    for index, block in enumerate(blocks):
        here = block_list.records_in(index, pooled)
        with block_on(block, options["calibration_device"]):
            runner = BlockRunner(model, block, options["calibration_device"])
            if here:
                block_energies, within = _spectra(runner, here, calls, options)
                energies.update(block_energies)
                gains.update({name: gain * block_gains[index] for name, gain in within.items()})
            if index < last:
                calls = run_block(runner, calls, _cache_device(options), block_list.prefix(index)[:-1])
    return plan_global(pooled, sizes.default, sizes.ratio_terms, multiple_of, {}, gains, energies)


def _fit_block(runner, todo: List[LayerRecord], original, current, options: dict) -> Dict[str, FitResult]:
    if not todo:
        return {}
    if options["sequential"]:
        return fit_planned(runner, todo, None, options, batches=original, converted_batches=current)
    calibration = collect_grams(runner, todo, current, False, options["calibration_device"])
    return fit_planned(runner, todo, calibration, options)


def _block_options(options: dict, todo: List[LayerRecord], first: Optional[LayerRecord]) -> dict:
    """``options`` for one block: no inner progress bars, seeds offset to the layer's place in ``todo``."""
    offset = 0 if first is None else todo.index(first)
    return {**options, "progress": False, "seed": None if options["seed"] is None else options["seed"] + offset}


def _swap_sending_home(model: nn.Module, block_fits: Dict[str, FitResult], home: Optional[torch.device]) -> SwapLog:
    """Swap the block's fitted layers in; the dense originals leave the block while it is on
    the calibration device, so they go back to the block's own device now (an undo, or a
    layer kept dense, puts them back into the model there)."""
    swaps = swap_modules(model, [(name, fit.module) for name, fit in block_fits.items()])
    if home is not None:
        for _, _, original in swaps:
            original.to(home)
    return swaps


def _convert_blocks(
    model: nn.Module, todo: List[LayerRecord], block_list: BlockList, calls, options: dict, log: SwapLog,
    after_fit: Optional[AfterFit],
) -> Dict[str, FitResult]:
    """Fit and swap the blocks' layers block by block (swaps appended to ``log``)."""
    last = max((i for i in range(len(block_list.blocks)) if block_list.records_in(i, todo)), default=-1)
    cache, fits = _cache_device(options), {}
    original = current = calls
    for index, block in enumerate(progress_bar(block_list.blocks[: last + 1], "converting", "block", options["progress"])):
        here, where, home = block_list.records_in(index, todo), block_list.prefix(index)[:-1], block_device(block)
        with block_on(block, options["calibration_device"]):
            runner = BlockRunner(model, block, options["calibration_device"])
            block_fits = _fit_block(runner, here, original, current, _block_options(options, todo, next(iter(here), None)))
            targets = run_block(runner, original, cache, where) if index < last or after_fit is not None else None
            log += _swap_sending_home(model, block_fits, home)
            fits.update(block_fits)
            if after_fit is not None:
                outputs = [hidden_states(call) for call in targets]
                after_fit(FittedBlock(index, where, block, runner, here, block_fits, current, outputs))
            if index < last:
                current = run_block(runner, current, cache, where) if options["sequential"] else targets
                original = targets
    return fits


def convert_by_blocks(
    model: nn.Module, todo: List[LayerRecord], block_list: BlockList, calls: List[BlockCall], options: dict,
    after_fit: Optional[AfterFit] = None,
) -> Tuple[Dict[str, FitResult], SwapLog]:
    """Fit and swap ``todo`` (sizes planned): the blocks' layers block by block on ``calls``
    (the first block's cached inputs), then the layers outside the blocks on the whole model.
    Without ``sequential``, every Gram is recorded on the dense model's activations (the
    original block feeds the next), as when the whole model is calibrated at once.
    ``after_fit`` is called with each :class:`FittedBlock`. Returns the fits and the swap
    log; on any error every swap is undone first."""
    log: SwapLog = []
    outside = [record for record in todo if not block_list.inside(record)]
    calibration = None
    if outside and not options["sequential"]:  # on the dense model, like the blocks' Grams
        data = options["calibration_data"]
        calibration = collect_grams(model, outside, data, False, options["calibration_device"])
    try:
        fits = _convert_blocks(model, todo, block_list, calls, options, log, after_fit)
        if outside:
            # sequential: the original runs are the dense model's, so the blocks are swapped out
            undo_swaps(log)
            log.clear()
            prefitted = {name: fit.module for name, fit in fits.items()}
            outside_options = _block_options(options, todo, outside[0])
            fits.update(fit_planned(model, outside, calibration, outside_options, prefitted=prefitted))
        log += swap_modules(model, [(name, fit.module) for name, fit in fits.items()])
    except BaseException:
        undo_swaps(log)
        raise
    return fits, log


def choose_blocks(model: nn.Module, records: List[LayerRecord], options: dict) -> Tuple[Optional[BlockList], str]:
    """``(block list, "block pipeline: ...")`` when convert runs block by block, else
    ``(None, "whole model: <why>")``; a ``blocks`` path that names no block list is a ValueError."""
    block_list, description = find_blocks(model, records, options["blocks"])
    data = options["calibration_data"]
    if block_list is not None:
        if data is None:
            block_list, description = None, "no calibration data, so nothing runs block by block"
        elif not reiterable(data):
            block_list, description = None, "calibration_data is a callable or a one-shot iterator, not a list of batches"
        else:
            problem = chain_problem(model, block_list, next(iter(data)))
            if problem is not None and options["blocks"] not in (None, "auto"):
                raise ValueError(f"blocks={options['blocks']!r}: {problem}; pass blocks=False")
            if problem is not None:
                block_list, description = None, problem
    return block_list, ("block pipeline: " if block_list is not None else "whole model: ") + description
