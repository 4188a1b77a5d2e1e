"""The out-of-core pipeline: the block pipeline on a model that is never whole in memory.

The model is a skeleton whose parameters live on the meta device
(:mod:`.skeleton_parts`); what lies outside its block list (embeddings, final norm, head) is
read from the checkpoint once, each block only for the steps that run it
(:meth:`OutOfCore.materialise`, the block pipeline's hook): read, moved to the calibration
device, then released. While fitting, each finished block is written to the output before the
next one is read, and the run's progress is committed (:class:`~panther_lite.conversion.saving.resume_state.RunState`),
so a killed run resumes after the last block written with the same result bit for bit.

The steps are the block pipeline's (:mod:`.by_blocks`, :mod:`.spectra`); what differs is what
needs the whole model there: the layers outside the blocks are calibrated and fitted on the
blocks' cached outputs (:class:`~panther_lite.conversion.pipelines.head_replay.HeadRunner`),
and the blocks' gains to the output (global allocation) come from a backward pass that streams
the blocks in reverse, from the block outputs of the first batch saved by :func:`probe`.
Reads of the checkpoint: the probe (the first batch through the whole model, also checking
that the blocks form a chain), a spectra pass and the reverse pass (global allocation only),
and the fitting pass.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..calibration.batches import CalibrationData, ModelRun
from ..calibration.grams import collect_grams
from ..config import ConvertConfig
from ..fitting.layer import FitResult
from ..fitting.planned import fit_planned
from ..planning.sizes import PlanNote, plan_uniform
from ..records import LayerRecord, check_finite_weights
from ..saving.checkpoint_files import CheckpointFiles
from ..saving.resume_state import RunState
from ..saving.serialization import CONFIG_FORMAT, CONFIG_VERSION, apply_conversion_config, conversion_config
from ..saving.shards import write_part
from ..surgery import SwapLog, swap_modules, undo_swaps
from .base import Conversion
from .blocks import BlockCall, BlockList, capture_inputs, chain_problem, find_blocks, hidden_states
from .by_blocks import BlockSchedule, ByBlocks, _convert_blocks
from .head_replay import HeadRunner, output_template, streamed_block_gains
from .skeleton_parts import SkeletonParts
from .spectra import _spectra, plan_global_by_blocks

__all__ = ["OutOfCore", "probe", "choose_out_of_core"]

_FIGURES = ("init", "trainable_params", "stored_params", "weight_error", "output_error")


def probe(parts: SkeletonParts, batch, keep_outputs: bool, state: RunState) -> Optional[str]:
    """Run ``batch`` through the whole model once, each block read from the checkpoint just for
    its call, and say why its blocks do not form a chain (:func:`~panther_lite.conversion.pipelines.blocks.chain_problem`)
    or None; with ``keep_outputs``, each block's output is saved in the run's scratch space
    (what :func:`~panther_lite.conversion.pipelines.head_replay.streamed_block_gains` reads)."""
    block_list = parts.block_list

    def after(index):
        def hook(module, args, output) -> None:
            if keep_outputs:
                torch.save((output if isinstance(output, torch.Tensor) else output[0]).detach(), _output_path(state, index))
            parts.release(index)

        return hook

    handles = []
    for index, block in enumerate(block_list.blocks):
        handles.append(block.register_forward_pre_hook(lambda module, args, i=index: parts.load(i), prepend=True))
        handles.append(block.register_forward_hook(after(index), always_call=True))
    try:
        return chain_problem(parts.model, block_list, batch)
    finally:
        for handle in handles:
            handle.remove()


def _output_path(state: RunState, index: int):
    return state.scratch(f"first-batch-output-{index:05d}.pt")


def _plan_record(records: List[LayerRecord], notes: Dict[str, PlanNote]) -> dict:
    """The plan as JSON: each record's status, reason and size, and the planner's notes."""
    return dict(
        records={r.name: [r.status, r.reason, r.num_terms, r.low_rank] for r in records},
        notes={name: [note.rank_multiple, note.budget_share] for name, note in notes.items()},
    )


def _restore_plan(records: List[LayerRecord], plan: dict) -> Dict[str, PlanNote]:
    for record in records:
        record.status, record.reason, record.num_terms, record.low_rank = plan["records"][record.name]
    return {name: PlanNote(*values) for name, values in plan["notes"].items()}


class OutOfCore(ByBlocks):
    """The pipeline converting a model streamed from its checkpoint block by block (see the
    module docstring): ``parts`` ties the skeleton to its checkpoint, ``state`` keeps the run's
    progress. ``description`` is the report's ``attrs["pipeline"]``."""

    name = "out of core"

    def __init__(
        self, block_list: BlockList, description: str, config: ConvertConfig, parts: SkeletonParts, state: RunState
    ) -> None:
        super().__init__(block_list, description, config)
        self.parts, self.state = parts, state
        self.writing, self.finished = False, 0
        self.streams: Optional[Tuple[List[BlockCall], List[BlockCall]]] = None
        self._template = None

    @contextlib.contextmanager
    def materialise(self, index: int, block: nn.Module) -> Iterator[None]:
        """Block ``index`` read from the checkpoint (its weights checked finite) and moved to the
        calibration device for the duration, then released; while fitting, written to the
        output first (not after an error)."""
        with self.parts.loaded(index, self.device):
            check_finite_weights([r for r in self.block_list.records_in(index, self.job.records) if r.to_convert])
            yield
            if self.writing:
                write_part(self.state.part_path(f"block-{index:05d}"), self.parts.state(index))

    def block_gains(self, blocks: List[nn.Module]) -> List[float]:
        """Each block's squared gain to the output, from the first batch's block outputs the
        probe saved and one reverse pass over the blocks (:func:`streamed_block_gains`)."""
        outputs = lambda index: torch.load(_output_path(self.state, index), weights_only=True)  # noqa: E731
        loaded = lambda index: self.parts.loaded(index, self.device)  # noqa: E731
        first = self.job.data.first_batch()
        return streamed_block_gains(self._head(), self.block_list, len(blocks), first, self._calls()[0], outputs,
                                    loaded, self.device)

    def _calls(self) -> List[BlockCall]:
        """The first block's cached calls, captured on first use (only the embeddings run)."""
        if not self.calls:
            job = self.job
            self.calls = capture_inputs(job.model, self.block_list, job.data.source, job.config.cache_device,
                                        job.config.progress)
        return self.calls

    def _head(self) -> HeadRunner:
        if self._template is None:
            self._template = output_template(self.block_list.blocks[0], self._calls()[0])
        return HeadRunner(self.job.model, self.block_list, self._template)

    def _head_batches(self, stream: List[BlockCall]) -> list:
        """``(batch, hidden states after the last block)`` for every calibration batch."""
        return [(batch, hidden_states(call)) for batch, call in zip(self.job.data.source, stream)]

    def _outside_spectra(self, records: List[LayerRecord], calls: List[BlockCall]) -> Tuple[dict, dict]:
        device = self.job.config.calibration_device
        return _spectra(self._head(), records, CalibrationData(self._head_batches(calls)), device)

    def plan(self, job: Conversion) -> Dict[str, PlanNote]:
        """The saved plan of a resumed run, else :meth:`ByBlocks.plan`'s (the layers outside the
        blocks from the blocks' outputs), saved when it took a pass over the blocks (global)."""
        self.job, config = job, job.config
        saved = self.state.plan()
        if saved is not None:
            return _restore_plan(job.records, saved)
        notes, pooled = plan_uniform(job.records, config)
        if pooled:
            notes.update(plan_global_by_blocks(
                job.model, pooled, self.block_list, self._calls(), config, job.data, self.materialise,
                self.block_gains, self._outside_spectra,
            ))
            self.state.save_plan(_plan_record(job.records, notes))  # a pass over the blocks: kept
        return notes

    def _commit(self, index: int, block_fits: Dict[str, FitResult], streams) -> None:
        """Record block ``index`` as written: its layers' fits and statuses, layout and
        refinement, and the calls the next block receives."""
        block = self.block_list.blocks[index]
        prefix = self.block_list.prefix(index)
        layers = [dict(entry, name=prefix + entry["name"]) for entry in conversion_config(block)["layers"]]
        here = self.block_list.records_in(index, self.job.records)
        record = dict(
            fits={name: [getattr(fit, figure) for figure in _FIGURES] for name, fit in block_fits.items()},
            records={r.name: [r.status, r.reason] for r in here}, layers=layers,
            refinement=[row for row in self.report_attrs().get("refinement", []) if row["block"] == index],
        )
        self.state.commit(index + 1, record, streams)
        self.finished, self.streams = index + 1, streams

    def _restore(self, name, job: Conversion) -> Dict[str, FitResult]:
        """The fits of a part a killed run finished (block index or ``"outside"``): statuses
        back in the records, placeholder layers (on the meta device) swapped into the skeleton."""
        saved = self.state.record(name)
        for record in job.records:
            if record.name in saved["records"]:
                record.status, record.reason = saved["records"][record.name]
        apply_conversion_config(job.model, dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=saved["layers"]))
        if self.refiner is not None:
            self.refiner.results += saved["refinement"]
        return {
            name: FitResult(job.model.get_submodule(name), **dict(zip(_FIGURES, figures)))
            for name, figures in saved["fits"].items()
        }

    def fit(self, job: Conversion) -> Tuple[Dict[str, FitResult], SwapLog]:
        """Fit, swap and write every block not written yet, then the layers outside the blocks
        (each part committed as it is written); earlier runs' parts are restored."""
        progress, log = self.state.progress(), []
        self.finished, self.streams, self.writing = progress["finished"], progress["streams"], True
        fits: Dict[str, FitResult] = {}
        for index in range(self.finished):
            fits.update(self._restore(index, job))
        if progress["outside"]:
            fits.update(self._restore("outside", job))
            return fits, log
        try:
            fits.update(self._fit_blocks(job, log))
            fits.update(self._fit_outside(job, log))
        except BaseException:
            undo_swaps(log)
            raise
        return fits, log

    def _fit_blocks(self, job: Conversion, log: SwapLog) -> Dict[str, FitResult]:
        """The blocks from the first one not written on: fitted, written and committed (those
        after the last with a layer to convert are copied through), the parts outside the
        blocks released meanwhile (read again after)."""
        outside = [record for record in job.todo if not self.block_list.inside(record)]
        count = len(self.block_list.blocks)
        original, current = self.streams if self.streams is not None else (None, None)
        schedule = BlockSchedule(self.finished, original, current, count - 1 if outside else None, self._commit)
        calls = self._calls() if self.finished == 0 else []
        self.parts.release(None)  # the embeddings and the head are not needed while the blocks are fitted
        fits = _convert_blocks(job.model, job.todo, self.block_list, calls, job.config, log, self.refiner,
                               self.materialise, schedule)
        for index in range(self.finished, count):
            with self.materialise(index, self.block_list.blocks[index]):
                pass
            self._commit(index, {}, None)
        self.parts.load(None)
        return fits

    def _fit_outside(self, job: Conversion, log: SwapLog) -> Dict[str, FitResult]:
        """The layers outside the blocks, fitted on the blocks' final outputs (the dense
        model's; sequentially also the converted one's), swapped in; then that part is written."""
        config, todo = job.config, job.todo
        outside = [record for record in todo if not self.block_list.inside(record)]
        fits = {}
        if outside:
            original, current = self.streams
            first_index = todo.index(outside[0])
            head = self._head()
            if config.sequential:
                fits = fit_planned(head, outside, config, None, self._head_batches(original), first_index=first_index,
                                   converted_batches=self._head_batches(current))
            else:
                data = CalibrationData(self._head_batches(original))
                calibration = collect_grams(head, outside, data, False, config.calibration_device)
                fits = fit_planned(head, outside, config, calibration, first_index=first_index)
            log += swap_modules(job.model, [(name, fit.module) for name, fit in fits.items()])
        write_part(self.state.part_path("outside"), self.parts.state(None))
        layers = [entry for entry in conversion_config(job.model)["layers"] if entry["name"] in fits]
        record = dict(fits={name: [getattr(fit, figure) for figure in _FIGURES] for name, fit in fits.items()},
                      records={r.name: [r.status, r.reason] for r in outside}, layers=layers, refinement=[])
        self.state.commit(len(self.block_list.blocks), record, None, outside=True)
        return fits

    def replay(self, job: Conversion) -> Optional[ModelRun]:
        """None: the whole model is never in memory to be run (each converted block ran in its
        own step, or is checked when the output is loaded)."""
        return None


def _data_problem(job: Conversion) -> Optional[str]:
    """Why the calibration data cannot be streamed through the blocks, or None."""
    data = job.data
    if not data.given:
        return "no calibration data, so nothing runs block by block"
    if not data.reiterable:
        return "calibration_data is a callable or a one-shot iterator, not a list of batches"
    return "calibration_data holds no batch" if data.first_batch() is None else None


def choose_out_of_core(job: Conversion, files: CheckpointFiles, state: RunState) -> Tuple[Optional[OutOfCore], str]:
    """``(OutOfCore, description)`` when ``job`` (on a skeleton of ``files``' model) can be
    streamed block by block, else ``(None, why not)``: the model has a block list (``blocks``),
    the calibration data is a non-empty list of batches, no parameter is tied across blocks, the
    checkpoint holds every tensor under the model's names, and the blocks form a chain on the
    first batch (:func:`probe`; not again when resuming a run that planned or wrote blocks). A ``blocks`` path
    whose blocks are not a chain is a ValueError. Chosen, the parts outside the blocks are loaded."""
    config = job.config
    block_list, description = find_blocks(job.model, job.records, config.blocks)
    problem = description if block_list is None else _data_problem(job)
    if problem is None and not files.files:
        problem = "MODEL_DIR has no safetensors weights to read block by block"
    if problem is not None:
        return None, problem
    parts = SkeletonParts(job.model, files, block_list)
    tied, missing = parts.ties_across_parts(), parts.missing()
    if tied or missing:
        return None, (f"parameters tied across blocks ({', '.join(tied[0])})" if tied else
                      f"the checkpoint holds no {', '.join(missing[:3])} (names other than the model's)")
    parts.load(None)
    if not state.holds_work:  # a run that planned or wrote blocks checked the chain already
        problem = probe(parts, job.data.first_batch(), config.allocation == "global", state)
        if problem is not None and config.blocks not in (None, "auto"):
            raise ValueError(f"blocks={config.blocks!r}: {problem}; pass blocks=False")
        if problem is not None:
            parts.release(None)
            return None, problem
    description = f"{OutOfCore.name}: {description}, each read from the checkpoint only while it is at work"
    return OutOfCore(block_list, description, config, parts, state), description
