"""The spectra pass of the block pipeline: a global allocation's statistics read block by block.

One pass over the dense blocks on the cached calls: each pooled layer's whitened spectrum (its
Gram freed at once) and its gain measured at its block's output
(:func:`~panther_lite.conversion.planning.sensitivity.output_gains` with the block as the
model) times the block's gain to the model's output (one forward and backward of the first
batch for all blocks, :func:`~panther_lite.conversion.planning.sensitivity.block_output_gains`);
pooled layers outside the blocks are calibrated on the whole model (their gain measured at the
model's output). A layer holding an output Fisher while its block runs (``output_fisher``)
offers its Fisher-weighted spectrum instead, weighed by its total
(:mod:`~panther_lite.conversion.planning.output_fisher`). Then
:func:`~panther_lite.conversion.planning.global_plan.plan_global` sizes every pooled layer.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch.nn as nn
from torch import Tensor

from ..calibration.batches import CalibrationData
from ..calibration.grams import collect_grams
from ..config import ConvertConfig
from ..planning.global_plan import plan_global
from ..planning.output_fisher import fisher_importances, fisher_totals
from ..planning.sensitivity import output_gains
from ..planning.sizes import PlanNote, rank_multiple_for
from ..records import LayerRecord
from ..progress import progress_bar
from .blocks import BlockList, BlockRunner, run_block
from .capture import BlockCalls, Materialise

BlockGains = Callable[[List[nn.Module]], List[float]]
OutsideSpectra = Callable[[List[LayerRecord], List[Tensor]], Tuple[dict, dict]]


def _spectra(model: nn.Module, pooled: List[LayerRecord], data: CalibrationData, config: ConvertConfig) -> Tuple[dict, dict]:
    """``({name: whitened spectrum}, {name: squared gain at model's output})`` of ``pooled``
    calibrated on ``data``; each Gram is freed as soon as its spectrum is taken."""
    calibration = collect_grams(model, pooled, data, False, config.calibration_device, config.held_back)
    energies = {}
    for record in pooled:
        recorder = calibration.recorders.get(record.name)
        energies.update(record.strategy.energies(record, recorder, config))
        calibration.release(record.name)
    return energies, output_gains(model, pooled, calibration.replay, config.sensitivity)


def _with_totals(totals: Dict[str, float], pooled: List[LayerRecord], spectra: Tuple[dict, dict]) -> Tuple[dict, dict]:
    """``spectra`` (:func:`_spectra` of ``pooled``), the totals of those holding an output Fisher
    added to ``totals`` (read while the Fishers are attached)."""
    totals.update(fisher_totals(pooled, spectra[0]))
    return spectra


def spectra_pass(
    model: nn.Module, pooled: List[LayerRecord], block_list: BlockList, captured: BlockCalls,
    config: ConvertConfig, data: CalibrationData, materialise: Materialise, block_gains: BlockGains,
    outside_spectra: Optional[OutsideSpectra] = None,
) -> Tuple[Dict[str, object], Dict[str, float]]:
    """``(energies, gains)`` of every pooled layer (see the module docstring; the gains are the
    plan's weights, :func:`~panther_lite.conversion.planning.output_fisher.fisher_importances`,
    where layers hold output Fishers while their block is materialised); each block is run
    inside ``materialise(index, block)``; ``block_gains(blocks)`` gives the squared gain of
    each block's output to the model's output. ``outside_spectra(records, hidden)``, when given,
    gives those of the pooled layers outside the blocks from the last block's hidden states
    (one tensor per batch; a pipeline that cannot run the whole model); the blocks then all run."""
    last = max((i for i in range(len(block_list.blocks)) if block_list.records_in(i, pooled)), default=-1)
    outside = [record for record in pooled if not block_list.inside(record)]
    device = config.calibration_device
    through = len(block_list.blocks) - 1 if outside and outside_spectra is not None else last - 1
    totals: Dict[str, float] = {}
    energies, gains = {}, {}
    if outside and outside_spectra is None:
        energies, gains = _with_totals(totals, outside, _spectra(model, outside, data, config))
    gains_to_output = block_gains(block_list.blocks[: last + 1])
    blocks = progress_bar(block_list.blocks[: max(last, through) + 1], "measuring spectra", "block", config.progress)
    hidden = captured.first()
    for index, block in enumerate(blocks):
        here, calls = block_list.records_in(index, pooled), captured.feed(index, hidden)
        with materialise(index, block):
            runner = BlockRunner(model, block, device)
            if here:
                block_energies, within = _with_totals(
                    totals, here, _spectra(runner, here, CalibrationData(captured.masked(calls)), config)
                )
                energies.update(block_energies)
                gains.update({name: gain * gains_to_output[index] for name, gain in within.items()})
            if index <= through:
                hidden = run_block(runner, calls, config.cache_device, block_list.prefix(index)[:-1])
    if outside and outside_spectra is not None:
        outside_energies, outside_gains = _with_totals(totals, outside, outside_spectra(outside, hidden))
        energies.update(outside_energies)
        gains.update(outside_gains)
    return energies, fisher_importances([record.name for record in pooled], gains, totals)


def plan_global_by_blocks(
    model: nn.Module, pooled: List[LayerRecord], block_list: BlockList, captured: BlockCalls,
    config: ConvertConfig, data: CalibrationData, materialise: Materialise, block_gains: BlockGains,
    outside_spectra: Optional[OutsideSpectra] = None,
) -> Dict[str, PlanNote]:
    """:func:`~panther_lite.conversion.planning.global_plan.plan_global` over ``pooled`` from
    one :func:`spectra_pass` over the dense blocks."""
    energies, gains = spectra_pass(
        model, pooled, block_list, captured, config, data, materialise, block_gains, outside_spectra
    )
    sizes = config.sizes
    return plan_global(pooled, sizes.default, sizes.ratio_terms, rank_multiple_for(config.align), {}, gains, energies)
