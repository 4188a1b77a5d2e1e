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
the blocks in reverse, from the first batch's block outputs saved by a forward pass over the
blocks. Reads of the checkpoint: the capture (every calibration batch through the whole model,
recording each block's own calls and checking that the blocks form a chain,
:meth:`ByBlocks.capture`; each block read once per batch), for global allocation a forward
pass, the reverse pass and a spectra pass, and the fitting pass. The captured calls are saved
in the run's scratch space, so a resumed run reads only the blocks it has left.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ..calibration.batches import CalibrationData, ModelRun, evaluation_run
from ..calibration.grams import collect_grams
from ..config import ConvertConfig
from ..fitting.layer import FitResult
from ..fitting.planned import fit_planned
from ..planning.output_fisher import attach_fishers, fisher_targets, release_fishers
from ..planning.sizes import PlanNote, plan_uniform
from ..process_groups.statistics import first_problem, measured_by_first
from ..records import LayerRecord, check_finite_weights, records_entry, restore_records
from ..saving.checkpoint_files import CheckpointFiles, check_placed, reported_unexpected
from ..saving.resume_state import RunState
from ..saving.serialization import CONFIG_FORMAT, CONFIG_VERSION, conversion_config, swap_in_conversion
from ..saving.shards import write_part
from ..saving.weight_files import writing
from ..surgery import SwapLog, swap_modules, undo_swaps
from .base import Conversion
from .blocks import BlockList, BlockRunner, find_blocks, run_block, with_hidden
from .by_blocks import BlockSchedule, ByBlocks, _convert_blocks
from .capture import BlockCalls
from .head_replay import HeadRunner, output_template, streamed_block_gains
from .streamed_fisher import BlockStreams, streamed_output_fishers
from .skeleton_parts import SkeletonParts
from .spectra import _spectra, plan_global_by_blocks

__all__ = ["OutOfCore", "choose_out_of_core"]

_FIGURES = (
    "init", "trainable_params", "stored_params", "weight_error", "output_error", "calibration_rows", "shrinkage"
)
_CAPTURED = "captured-calls.pt"
_FISHERS = "output-fisher-{}.pt"


def _output_path(state: RunState, index: int):
    return state.scratch(f"first-batch-output-{index:05d}.pt")


def _stream_path(state: RunState, index: int):
    return state.scratch(f"block-outputs-{index:05d}.pt")


def _plan_record(records: List[LayerRecord], notes: Dict[str, PlanNote]) -> dict:
    """The plan as JSON: each record's status, reason and size (and its parts' sizes, for a
    layer of several weight stacks), and the planner's notes."""
    return dict(
        records={r.name: [r.status, r.reason, r.num_terms, r.low_rank] for r in records},
        parts={p.name: [p.num_terms, p.low_rank] for r in records for p in r.parts if p is not r},
        notes={name: [note.rank_multiple, note.budget_share] for name, note in notes.items()},
    )


def _restore_plan(records: List[LayerRecord], plan: dict) -> Dict[str, PlanNote]:
    for record in records:
        record.status, record.reason, record.num_terms, record.low_rank = plan["records"][record.name]
        for part in record.parts:
            if part is not record:
                part.num_terms, part.low_rank = plan["parts"][part.name]
    return {name: PlanNote(*values) for name, values in plan["notes"].items()}


def _fit_entry(fit: FitResult) -> dict:
    """A fit's report figures as JSON (its parts' too, and the columns its kind adds)."""
    return dict(figures=[getattr(fit, figure) for figure in _FIGURES], extra=fit.extra,
                parts={name: _fit_entry(part) for name, part in fit.parts.items()})


def _restored_fit(module: nn.Module, entry: dict) -> FitResult:
    parts = {name: _restored_fit(module, part) for name, part in entry["parts"].items()}
    return FitResult(module, **dict(zip(_FIGURES, entry["figures"])), parts=parts, extra=entry["extra"])


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
        self.writing, self.finished, self.fishers_measured = False, 0, False
        self.streams: Optional[Tuple[List[Tensor], List[Tensor]]] = None
        self._template = None

    @contextlib.contextmanager
    def materialise(self, index: int, block: nn.Module) -> Iterator[None]:
        """Block ``index`` read from the checkpoint (its weights checked finite) and moved to the
        calibration device for the duration, then released; while fitting, written to the
        output first (not after an error); with ``output_fisher``, once measured, its layers hold
        their Fishers for the duration."""
        records = self.block_list.records_in(index, self.job.records)
        with self.parts.loaded(index, self.device):
            check_finite_weights([r for r in records if r.to_convert])
            if self.fishers_measured:
                self._attach_fishers(index, records)
            try:
                yield
            finally:
                release_fishers(records)
            if self.writing and self.state.writes:  # across processes: rank 0 alone writes
                write_part(self.state.part_path(f"block-{index:05d}"), self.parts.state(index))

    def capture(self, job: Conversion) -> Optional[str]:
        """:meth:`ByBlocks.capture` (each block read once per batch), its calls saved in the
        run's scratch space (a resumed run takes them from there instead), and what a block
        returns (the head replay's template, :func:`output_template`)."""
        self.job = job
        saved = self.state.load_scratch(_CAPTURED)
        if saved is not None:
            self.captured = BlockCalls(saved["calls"], saved["masks"])
        else:
            problem = super().capture(job)
            if problem is not None:
                return problem
            self.state.save_scratch(_CAPTURED, dict(calls=self.captured.calls, masks=self.captured.masks))
        self._template = output_template(self.block_list.blocks[0], self.captured.calls[0][0], self._first_output)
        return None

    def _first_output(self):
        """Block 0's output on the first batch, the block read for it (still dense: before any fit)."""
        block, call = self.block_list.blocks[0], self.captured.calls[0][0]
        with self.parts.loaded(0, self.device), evaluation_run(block):
            return BlockRunner(self.job.model, block, self.device)(*call)

    def _save_first_outputs(self) -> None:
        """Each block's output on the first batch, in the run's scratch space (one forward pass)."""
        calls, hidden = self.captured.calls[0], self.captured.first()[0]
        for index, block in enumerate(self.block_list.blocks):
            with self.materialise(index, block):
                runner = BlockRunner(self.job.model, block, self.device)
                where = self.block_list.prefix(index)[:-1]
                (hidden,) = run_block(runner, [with_hidden(calls[index], hidden)], self.job.config.cache_device, where)
            with writing(_output_path(self.state, index)):
                torch.save(hidden, _output_path(self.state, index))

    @measured_by_first  # across processes: rank 0, which holds the first batch, alone streams the blocks for it
    def block_gains(self, blocks: List[nn.Module]) -> List[float]:
        """Each block's squared gain to the output, from the first batch's block outputs (one
        forward pass) and one reverse pass over the blocks (:func:`streamed_block_gains`)."""
        self._save_first_outputs()
        outputs = lambda index: torch.load(_output_path(self.state, index), weights_only=True)  # noqa: E731
        loaded = lambda index: self.parts.loaded(index, self.device)  # noqa: E731
        first = self.job.data.first_batch()
        return streamed_block_gains(self._head(), self.block_list, len(blocks), first, self.captured.calls[0], outputs,
                                    loaded, self.device, self.job.config.sensitivity)

    def _head(self) -> HeadRunner:
        return HeadRunner(self.job.model, self.block_list, self._template)

    def _head_batches(self, hidden: List[Tensor]) -> list:
        """``(batch, hidden states after the last block)`` for every calibration batch."""
        return list(zip(self.job.data.source, hidden))

    def _outside_spectra(self, records: List[LayerRecord], hidden: List[Tensor]) -> Tuple[dict, dict]:
        """:func:`_spectra` of the pooled ``records`` outside the blocks (holding their Fishers
        meanwhile, when measured) on the last block's outputs ``hidden``."""
        if self.fishers_measured:
            self._attach_fishers("outside", records)
        try:
            return _spectra(self._head(), records, CalibrationData(self._head_batches(hidden)), self.job.config)
        finally:
            release_fishers(records)

    def plan(self, job: Conversion) -> Dict[str, PlanNote]:
        """With ``output_fisher``, the layers' Fishers measured first (unless a killed run saved
        them; a global plan reads them too); then the saved plan of a resumed run, else
        :meth:`ByBlocks.plan`'s (the layers outside the blocks from the blocks' outputs), saved
        when it took a pass over the blocks (global)."""
        self.job, config = job, job.config
        if config.output_fisher:
            self._measure_fishers(job)
            self.fishers_measured = True
        saved = self.state.plan()
        return _restore_plan(job.records, saved) if saved is not None else self._new_plan(job)

    def _new_plan(self, job: Conversion) -> Dict[str, PlanNote]:
        notes, pooled = plan_uniform(job.records, job.config)
        if pooled:
            notes.update(plan_global_by_blocks(
                job.model, pooled, self.block_list, self.captured, job.config, job.data, self.materialise,
                self.block_gains, self._outside_spectra,
            ))
            self.state.save_plan(_plan_record(job.records, notes))  # a pass over the blocks: kept
        return notes

    def _measure_fishers(self, job: Conversion) -> None:
        """Each block's layers' output Fishers (:func:`streamed_output_fishers`: a forward and a
        reverse pass over the blocks), saved per block in the run's scratch space as float32 (a
        resumed run that saved them all measures nothing); the blocks' outputs it kept meanwhile
        are deleted after. Each block's file is deleted when the block is committed."""
        if self.state.load_scratch(_FISHERS.format("done")) is not None:
            return

        def store(index: int, outputs: List[Tensor]) -> None:
            with writing(_stream_path(self.state, index)):
                torch.save(outputs, _stream_path(self.state, index))

        def keep(part, fishers: Dict[str, Tensor]) -> None:
            self.state.save_scratch(_FISHERS.format(part), {name: fisher.float() for name, fisher in fishers.items()})

        streams = BlockStreams(lambda index: self.parts.loaded(index, self.device), store,
                               lambda index: torch.load(_stream_path(self.state, index), weights_only=True), keep,
                               self.device, job.config.cache_device)
        streamed_output_fishers(
            job.model, self._head(), self.block_list, self.captured, list(job.data.source), fisher_targets(job.records),
            streams, seed=job.config.seed or 0, progress=job.config.progress,
        )
        for index in range(len(self.block_list.blocks)):
            _stream_path(self.state, index).unlink(missing_ok=True)
        self.state.save_scratch(_FISHERS.format("done"), {})

    def _attach_fishers(self, part, records: List[LayerRecord]) -> None:
        """With ``output_fisher``, the saved Fishers of ``part`` (a block index or ``"outside"``) set
        on its ``records`` to convert (:func:`~panther_lite.conversion.planning.output_fisher.attach_fishers`)."""
        if self.job.config.output_fisher:
            attach_fishers(fisher_targets(records), self.state.load_scratch(_FISHERS.format(part)) or {})

    def _commit(self, index: int, block_fits: Dict[str, FitResult], streams) -> None:
        """Record block ``index`` as written: its layers' fits and statuses, layout and
        refinement, and the hidden states the next block receives (its saved Fishers deleted)."""
        block = self.block_list.blocks[index]
        prefix = self.block_list.prefix(index)
        layers = [dict(entry, name=prefix + entry["name"]) for entry in conversion_config(block)["layers"]]
        here = self.block_list.records_in(index, self.job.records)
        record = dict(
            fits={name: _fit_entry(fit) for name, fit in block_fits.items()}, layers=layers, **records_entry(here),
            refinement=[row for row in self.report_attrs().get("refinement", []) if row["block"] == index],
        )
        self.state.commit(index + 1, record, streams)
        self.state.scratch(_FISHERS.format(index)).unlink(missing_ok=True)  # fitted: its Fishers are spent
        self.finished, self.streams = index + 1, streams

    def _restore(self, name, job: Conversion) -> Dict[str, FitResult]:
        """The fits of a part a killed run finished (block index or ``"outside"``): statuses
        back in the records, placeholder layers (on the meta device) swapped into the skeleton."""
        saved = self.state.record(name)
        restore_records(job.records, saved)
        swap_in_conversion(job.model, dict(format=CONFIG_FORMAT, version=CONFIG_VERSION, layers=saved["layers"]))
        if self.refiner is not None:
            self.refiner.results += saved["refinement"]
        return {name: _restored_fit(job.model.get_submodule(name), entry) for name, entry in saved["fits"].items()}

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
        self.parts.release(None)  # the embeddings and the head are not needed while the blocks are fitted
        fits = _convert_blocks(job.model, job.todo, self.block_list, self.captured, job.config, log, self.refiner,
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
            self._attach_fishers("outside", outside)
            if config.sequential:
                fits = fit_planned(head, outside, config, None, self._head_batches(original), first_index=first_index,
                                   converted_batches=self._head_batches(current))
            else:
                data = CalibrationData(self._head_batches(original))
                calibration = collect_grams(head, outside, data, False, config.calibration_device, config.held_back)
                fits = fit_planned(head, outside, config, calibration, first_index=first_index)
            release_fishers(outside)
            log += swap_modules(job.model, [(name, fit.module) for name, fit in fits.items()])
        if self.state.writes:
            write_part(self.state.part_path("outside"), self.parts.state(None))
        layers = [entry for entry in conversion_config(job.model)["layers"] if entry["name"] in fits]
        record = dict(fits={name: _fit_entry(fit) for name, fit in fits.items()}, **records_entry(outside),
                      layers=layers, refinement=[])
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
    checkpoint holds every tensor under the model's names (and no tensor the model does not
    place: a ValueError naming them), and replaying the blocks one by one
    gives the whole-model result on every batch (:meth:`OutOfCore.capture`, the block
    pipeline's capture streamed; a resumed run's saved capture). A ``blocks`` path whose blocks
    cannot be replayed exactly is a ValueError. Chosen, the parts outside the blocks are loaded."""
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
    check_placed(files.directory, reported_unexpected(job.model, parts.unplaced()))
    parts.load(None)
    description = f"{OutOfCore.name}: {description}, each read from the checkpoint only while it is at work"
    pipeline = OutOfCore(block_list, description, config, parts, state)
    problem = first_problem(pipeline.capture(job))  # across processes: the same pipeline on every rank
    if problem is not None and config.blocks not in (None, "auto"):
        raise ValueError(f"blocks={config.blocks!r}: {problem}; pass blocks=False")
    if problem is not None:
        parts.release(None)
        return None, problem
    return pipeline, description
