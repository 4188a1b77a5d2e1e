"""The by-blocks pipeline: calibrate, plan, fit and swap a model's repeated blocks one at a time
on cached block inputs, so time grows linearly with depth and memory holds one block's
statistics (plus the cached hidden states).

Each block's own calls are captured once, in one run of every calibration batch that also
checks that a replay is exact (:meth:`ByBlocks.capture`,
:func:`~panther_lite.conversion.pipelines.capture.capture_calls`). Then per block: its selected
layers' Grams are recorded by running the block alone on its cached calls (the same tensors a
whole-model forward feeds it, so a non-sequential fit is the same as on the whole model), the
layers are fitted and swapped in, and the block is run once on the calls to produce the next
block's inputs: the original block (before the swap), so every Gram comes from the dense model's
activations as when the whole model is calibrated at once. ``sequential=True`` keeps two
streams of calls, the original model's and the partly converted one's (the converted block
feeds it): each layer is fitted to reproduce the original block's outputs from the inputs it
now receives (:mod:`~panther_lite.conversion.fitting.sequential`). ``allocation="global"`` first
makes one spectra pass over the dense blocks (:mod:`.spectra`). Selected layers outside the
blocks (``lm_head``, a pooler) are calibrated and fitted on the whole model afterwards, as
without blocks. Any failure undoes every swap.

Each step that runs a block alone does so inside :meth:`ByBlocks.materialise` (default: the
block moved to the calibration device and back) and the blocks' gains to the output come from
:meth:`ByBlocks.block_gains`: the hooks a pipeline that loads blocks from disk overrides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..calibration.batches import CalibrationData, ModelRun, run_batch
from ..calibration.grams import collect_grams
from ..config import ConvertConfig
from ..fitting.block_refinement import AfterFit, BlockRefiner, FittedBlock
from ..fitting.layer import FitResult
from ..fitting.planned import fit_planned
from ..planning.sensitivity import block_output_gains
from ..planning.output_fisher import attach_output_fishers, release_fishers
from ..planning.sizes import PlanNote, plan_uniform
from ..records import LayerRecord
from ..progress import progress_bar
from ..surgery import SwapLog, swap_modules, undo_swaps
from .base import Conversion
from .blocks import BlockList, BlockRunner, block_device, block_on, run_block
from .capture import BlockCalls, BrokenChain, Materialise, capture_calls, chain_problem
from .spectra import plan_global_by_blocks


def _fit_block(runner, here: List[LayerRecord], original, current, config: ConvertConfig, first_index: int):
    """The fits of one block's layers, on the original and current streams of cached calls
    (each with its batch's token mask, :meth:`~panther_lite.conversion.pipelines.capture.BlockCalls.masked`)."""
    if not here:
        return {}
    if config.sequential:
        return fit_planned(runner, here, config, None, original, first_index=first_index, converted_batches=current)
    data = CalibrationData(current)
    calibration = collect_grams(runner, here, data, False, config.calibration_device, config.held_back)
    return fit_planned(runner, here, config, calibration, first_index=first_index)


def _send_home(swaps: SwapLog, home: Optional[torch.device]) -> None:
    """The dense originals a block's swaps took out leave the calibration device once the block
    is done with them (refinement reads them), for the block's own device (an undo, or a layer
    kept dense, puts them back into the model there)."""
    if home is not None:
        for _, _, original in swaps:
            original.to(home)


@dataclass
class BlockSchedule:
    """Where :func:`_convert_blocks` starts and stops, and who hears of each finished block (a
    pipeline saving its progress, :mod:`.out_of_core`): from block ``start`` on the streams
    ``original`` and ``current`` (each block ``start``'s hidden states, one tensor per batch;
    None: the first block's captured ones, for both); the blocks run through block ``through``
    included (None: as far as the last block holding a layer to convert needs them);
    ``done(index, block_fits, streams)`` is called once block ``index`` is swapped and out of
    ``materialise``, ``streams`` the next block's ``(original, current)`` hidden states (None: not run)."""

    start: int = 0
    original: Optional[List[Tensor]] = None
    current: Optional[List[Tensor]] = None
    through: Optional[int] = None
    done: Optional[Callable[[int, Dict[str, FitResult], Optional[Tuple[list, list]]], None]] = None


def _convert_blocks(
    model: nn.Module, todo: List[LayerRecord], block_list: BlockList, captured: BlockCalls, config: ConvertConfig,
    log: SwapLog, after_fit: Optional[AfterFit], materialise: Materialise, schedule: Optional[BlockSchedule] = None,
) -> Dict[str, FitResult]:
    """Fit and swap the blocks' layers block by block (swaps appended to ``log``), their
    statistics and refinement losses on the real tokens of ``captured``'s batches, as
    ``schedule`` says."""
    schedule = schedule or BlockSchedule()
    last = max((i for i in range(len(block_list.blocks)) if block_list.records_in(i, todo)), default=-1)
    through = last - 1 if schedule.through is None else max(last - 1, schedule.through)
    cache, device, fits = config.cache_device, config.calibration_device, {}
    # each stream's hidden states, one tensor per batch
    original = captured.first() if schedule.original is None else schedule.original
    current = original if schedule.current is None else schedule.current
    for index in progress_bar(range(schedule.start, max(last, through) + 1), "converting", "block", config.progress):
        block, advance = block_list.blocks[index], index <= through
        here, where, home = block_list.records_in(index, todo), block_list.prefix(index)[:-1], block_device(block)
        with materialise(index, block):
            runner = BlockRunner(model, block, device)
            first_index = todo.index(here[0]) if here else 0
            original_calls = captured.feed(index, original)
            current_calls = captured.feed(index, current) if config.sequential else original_calls
            streams = captured.masked(original_calls), captured.masked(current_calls)
            block_fits = _fit_block(runner, here, *streams, config, first_index)
            targets = run_block(runner, original_calls, cache, where) if advance or after_fit is not None else None
            swaps = swap_modules(model, [(name, fit.module) for name, fit in block_fits.items()])
            log += swaps
            fits.update(block_fits)
            if after_fit is not None:
                after_fit(FittedBlock(index, where, block, runner, here, block_fits, current_calls, targets, captured.masks))
            if advance:
                current = run_block(runner, current_calls, cache, where) if config.sequential else targets
                original = targets
            _send_home(swaps, home)
        if schedule.done is not None:
            schedule.done(index, block_fits, (original, current) if advance else None)
    return fits


def convert_by_blocks(
    job: Conversion, block_list: BlockList, captured: BlockCalls, after_fit: Optional[AfterFit],
    materialise: Materialise,
) -> Tuple[Dict[str, FitResult], SwapLog]:
    """Fit and swap ``job.todo`` (sizes planned): the blocks' layers block by block on the
    ``captured`` calls, each inside ``materialise(index, block)``, then the
    layers outside the blocks on the whole model.
    Without ``sequential``, every Gram is recorded on the dense model's activations (the
    original block feeds the next), as when the whole model is calibrated at once.
    ``after_fit`` is called with each :class:`~panther_lite.conversion.fitting.block_refinement.FittedBlock`.
    Returns the fits and the swap log; on any error every swap is undone first."""
    model, todo, config, log = job.model, job.todo, job.config, []
    outside = [record for record in todo if not block_list.inside(record)]
    calibration = None
    if outside and not config.sequential:  # on the dense model, like the blocks' Grams
        calibration = collect_grams(model, outside, job.data, False, config.calibration_device, config.held_back)
    try:
        fits = _convert_blocks(model, todo, block_list, captured, config, log, after_fit, materialise)
        if outside:
            # sequential: the original runs are the dense model's, so the blocks are swapped out
            undo_swaps(log)
            log.clear()
            prefitted = {name: fit.module for name, fit in fits.items()}
            fits.update(fit_planned(
                model, outside, config, calibration, job.data.source, first_index=todo.index(outside[0]),
                prefitted=prefitted,
            ))
        log += swap_modules(model, [(name, fit.module) for name, fit in fits.items()])
    except BaseException:
        undo_swaps(log)
        raise
    return fits, log


class ByBlocks:
    """The pipeline converting a model's block list block by block (see the module docstring).

    ``description`` is the report's ``attrs["pipeline"]``; with a ``refine`` config each block
    is refined after its fits (:class:`~panther_lite.conversion.fitting.block_refinement.BlockRefiner`).
    """

    name = "block pipeline"

    def __init__(self, block_list: BlockList, description: str, config: ConvertConfig) -> None:
        self.block_list, self.description = block_list, description
        self.device = config.calibration_device
        self.refiner = None if config.refine is None else BlockRefiner(config.refine)
        self.captured: Optional[BlockCalls] = None
        self.job: Optional[Conversion] = None

    def capture(self, job: Conversion) -> Optional[str]:
        """Capture every block's calls on ``job``'s calibration batches (each block run inside
        :meth:`materialise`); the reason a replay would not give the whole-model result, or None
        (:func:`~panther_lite.conversion.pipelines.capture.chain_problem`,
        :func:`~panther_lite.conversion.pipelines.capture.capture_calls`). Called by
        :func:`~panther_lite.conversion.pipelines.choose_pipeline` before :meth:`plan`."""
        config = job.config
        problem = chain_problem(job.model, self.block_list, job.records)
        if problem is not None:
            return problem
        try:
            self.captured = capture_calls(
                job.model, self.block_list, job.records, job.data.source, sequential=config.sequential,
                cache_device=config.cache_device, materialise=self.materialise, progress=config.progress,
            )
        except BrokenChain as broken:
            return str(broken)
        return None

    def materialise(self, index: int, block: nn.Module) -> ContextManager:
        """The hook around every step that runs block ``index`` alone: the block ready to run
        for the duration (here: moved to the calibration device, then back), released after."""
        return block_on(block, self.device)

    def block_gains(self, blocks: List[nn.Module]) -> List[float]:
        """The hook giving each block's squared gain to the model's output (global allocation):
        here one forward and backward of the first calibration batch through the whole model."""
        first = self.job.data.first_batch()
        return block_output_gains(self.job.model, blocks, lambda module: run_batch(module, first), self.job.config.sensitivity)

    def plan(self, job: Conversion) -> Dict[str, PlanNote]:
        """Size the layers (a global plan from one spectra pass over the captured calls) and,
        with ``output_fisher``, measure each layer's output Fisher on the whole model first (the
        plan reads it too)."""
        config, self.job = job.config, job
        notes, pooled = plan_uniform(job.records, config)
        if config.output_fisher:
            attach_output_fishers(job.model, job.records, job.data, config.seed)
        if pooled:
            notes.update(plan_global_by_blocks(
                job.model, pooled, self.block_list, self.captured, config, job.data, self.materialise, self.block_gains
            ))
        return notes

    def fit(self, job: Conversion) -> Tuple[Dict[str, FitResult], SwapLog]:
        try:
            return convert_by_blocks(job, self.block_list, self.captured, self.refiner, self.materialise)
        finally:
            release_fishers(job.records)

    def replay(self, job: Conversion) -> Optional[ModelRun]:
        return job.data.replay()

    def report_attrs(self) -> dict:
        return {} if self.refiner is None else {"refinement": self.refiner.results}
