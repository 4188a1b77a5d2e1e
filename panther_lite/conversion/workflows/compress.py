"""``compress_checkpoint``: a transformers checkpoint directory converted into a new one without
ever loading the model whole (the out-of-core pipeline,
:mod:`~panther_lite.conversion.pipelines.out_of_core`), written through a staging directory
from which a killed run resumes; a model that cannot be streamed is loaded whole, saying why."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from ...extras import require
from ...nn.validation import check_bool
from ...version import __version__
from ..calibration.batches import CalibrationData, add_to_digest
from ..config import ConvertConfig
from ..process_groups.group import active_run, running_on
from ..process_groups.run import check_compress_across, distributed_conversion, resolve_run
from ..process_groups.own_group import owned_copy
from ..process_groups.run_state import announcing, await_staging
from ..fitting.block_refinement import REFINEMENT_COLUMNS
from ..pipelines.blocks import without_kv_cache
from ..pipelines.out_of_core import choose_out_of_core
from .convert import convert, run_pipeline
from .setup import conversion_job, conversion_options
from ..saving.checkpoint_files import CheckpointFiles
from ..saving.loading import from_pretrained
from ..saving.pretrained import save_pretrained, save_transformers_config
from ..saving.resume_state import RESUME_DIRECTORY, RunState, filter_fingerprint
from ..saving.serialization import conversion_config
from ..saving.shards import finalize_shards, shard_name
from ..saving.staging import staged_directory, staging_path
from ..saving.weight_files import writing

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["compress_checkpoint", "REPORT_CSV", "REPORT_PNG", "REFINEMENT_CSV"]

REPORT_CSV, REPORT_PNG, REFINEMENT_CSV = "report.csv", "report.png", "refinement.csv"
_CONVERTED = "converted"  # with distill: the converted checkpoint, in the resume directory until distilled
_COPIED = ("generation_config.json",)
Distiller = Callable[[torch.nn.Module, Optional[Path]], object]
"""``distill(model, directory)``: trains the converted ``model`` (against the original's outputs,
cached before the conversion: :func:`~panther_lite.teacher_outputs`), may write files into
``directory`` (the output, staged; None on the processes other than rank 0, which write nothing)."""  # files of MODEL_DIR the model's own save_pretrained writes too


def _options_record(config: ConvertConfig, own: dict) -> dict:
    """The options that shape the result, as JSON (``progress`` does not)."""
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and f.name != "progress"}
    fingerprint, problem = filter_fingerprint(options["filter_fn"])
    options["filter_fn"] = fingerprint if problem is None else f"not fingerprinted ({secrets.token_hex(8)})"
    options["refine"] = None if config.refine is None else dataclasses.asdict(config.refine)
    return json.loads(json.dumps({**options, **own}, default=str))


def _data_digest(source) -> str:
    """sha256 of the calibration batches (:func:`~panther_lite.conversion.calibration.batches.add_to_digest`)."""
    digest = hashlib.sha256()
    for batch in [source] if source is None or callable(source) else source:
        add_to_digest(digest, batch)
    return digest.hexdigest()


def _fingerprint(files: CheckpointFiles, config: ConvertConfig, data: CalibrationData, own: dict) -> dict:
    versions = {"panther_lite": __version__, "torch": torch.__version__}
    return dict(checkpoint=files.fingerprint(), options=_options_record(config, own), data=_data_digest(data.source),
                versions=versions)


def _write_reports(report: "pd.DataFrame", directory: Path, title: str) -> None:
    """``report.csv``, ``refinement.csv`` (with refinement) and ``report.png`` (a warning
    instead when matplotlib, the ``[bench]`` extra, is missing: the model is written without it)."""
    import pandas as pd

    from ..report_plot import plot_conversion_report  # pandas and matplotlib: imported when a report is written

    report.to_csv(directory / REPORT_CSV, index=False)
    if "refinement" in report.attrs:
        pd.DataFrame(report.attrs["refinement"], columns=REFINEMENT_COLUMNS).to_csv(directory / REFINEMENT_CSV,
                                                                                     index=False)
    try:
        plot_conversion_report(report, directory / REPORT_PNG, title=f"{title}: {report.attrs['summary']}")
    except ModuleNotFoundError as error:
        if not str(error.name).startswith("matplotlib"):
            raise
        warnings.warn(f"{REPORT_PNG} not written: {error}", UserWarning, stacklevel=3)


def _copy_side_files(files: CheckpointFiles, directory: Path) -> None:
    """The tokenizer (when MODEL_DIR has one) and the files the model's own save writes beside its weights."""
    transformers = require("transformers", "compress_checkpoint")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(files.directory))
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None  # a checkpoint without a tokenizer is still a checkpoint
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    for name in _COPIED:
        if (files.directory / name).is_file() and not (directory / name).exists():
            shutil.copyfile(files.directory / name, directory / name)


def _convert_whole(
    files: CheckpointFiles, dtype: torch.dtype, config: ConvertConfig, data: CalibrationData, directory: Path,
    why: str, distill: Optional[Distiller], allow_missing: bool,
) -> "pd.DataFrame":
    """The checkpoint loaded whole, converted (then distilled) and saved; tensors it lacks are an
    error unless ``allow_missing`` (then ``attrs["random_weights"]`` names them)."""
    model, random = files.load_whole(dtype, allow_missing)
    if random and directory is not None:
        warnings.warn(f"compress_checkpoint: MODEL_DIR lacks {len(random)} tensor(s), initialised at random "
                      f"(allow_missing_weights=True): {', '.join(random[:5])}", UserWarning, stacklevel=4)
    with without_kv_cache(model):
        report = convert(model, config, calibration_data=data.source)
    report.attrs["pipeline"] += f" (the model loaded whole: {why})"
    report.attrs["random_weights"] = random
    if distill is not None:
        distill(model, directory)
    if directory is not None:
        save_pretrained(model, directory)
    return report


def _distill_written(files: CheckpointFiles, dtype: torch.dtype, converted: Path, directory: Optional[Path],
                     distill: Distiller) -> None:
    """The converted checkpoint written in ``converted`` (by rank 0; the others wait for it) loaded
    at its own, compressed size, trained by ``distill`` (on every rank) and saved into ``directory``
    (rank 0's; None elsewhere)."""
    run = active_run()
    if run is not None:
        run.barrier("rank 0 writing the converted checkpoint to distill")
    model = from_pretrained(files.auto_class, converted, dtype=dtype)
    distill(model, directory)
    if directory is not None:
        save_pretrained(model, directory)


def _take_back(parts: List[Path], elsewhere: Path, converted: Path) -> None:
    """The ``parts`` an earlier run already moved into ``elsewhere`` as its shards (and not yet into
    ``converted``), moved back: a run with ``distill`` finalizes the shards in the scratch space,
    one without in the output, so a conversion resumes with the distillation turned on or off."""
    for index, part in enumerate(parts):
        name = shard_name(index, len(parts))
        if not part.exists() and not (converted / name).exists() and (elsewhere / name).exists():
            os.replace(elsewhere / name, part)


def _convert_into(
    files: CheckpointFiles, dtype: torch.dtype, config: ConvertConfig, data: CalibrationData, state: RunState,
    directory: Optional[Path], in_memory: bool, allow_missing: bool, distill: Optional[Distiller],
) -> "pd.DataFrame":
    """Convert the checkpoint into ``directory``: streamed when it can be (with ``distill``, into the
    resume directory, then loaded, distilled and saved), else loaded whole. Across processes each
    rank streams its own batches; ``directory`` is None on the ranks other than 0, which write nothing."""
    model = files.skeleton(dtype)
    with distributed_conversion(None, config, data) as shard:  # this rank's batches (all of them in one process)
        job = conversion_job(model, config, shard, meta_loaded_later=True)
        pipeline, why = (None, "in_memory=True") if in_memory else choose_out_of_core(job, files, state)
        if pipeline is not None:
            with without_kv_cache(model):
                report, _ = run_pipeline(job, pipeline)
    if pipeline is None:
        if not in_memory and directory is not None:
            warnings.warn(f"compress_checkpoint: loading {str(files.directory)!r} whole: {why}", UserWarning, stacklevel=3)
        report = _convert_whole(files, dtype, config, data, directory, why, distill, allow_missing)
    if pipeline is not None:
        converted = directory if distill is None else state.scratch(_CONVERTED)
        if directory is not None:
            count = len(pipeline.block_list.blocks)
            parts = [state.part_path("outside"), *(state.part_path(f"block-{index:05d}") for index in range(count))]
            converted.mkdir(exist_ok=True)
            _take_back(parts, state.scratch(_CONVERTED) if distill is None else directory, converted)
            finalize_shards(parts, converted)
            save_transformers_config(model, converted, conversion_config(model))
        if distill is not None:
            _distill_written(files, dtype, converted, directory, distill)
    if directory is None:
        return report
    _copy_side_files(files, directory)
    _write_reports(report, directory, Path(os.path.abspath(files.directory)).name)
    return report


def _convert_elsewhere(
    run, model_dir, config: ConvertConfig, data: CalibrationData, dtype, in_memory: bool, allow_missing: bool,
    distill: Optional[Distiller],
) -> "pd.DataFrame":
    """A rank other than 0 across processes, once rank 0 has announced its staging directory: its
    share of the conversion (its statistics summed into rank 0's, its hidden states kept for a
    resume) and of the distillation, nothing written; it waits at a barrier until rank 0 has
    written the output. A failure on any rank meanwhile stops every rank quoting it."""
    files = CheckpointFiles(Path(model_dir))
    state = await_staging(run, streamed=not in_memory)
    with state.notes.sharing():
        with running_on(run):
            report = _convert_into(files, dtype or files.default_dtype(), config, data, state, None, in_memory,
                                   allow_missing, distill)
        run.barrier("rank 0 writing the output")
    return report


def _check_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None (the checkpoint's) or a floating-point torch.dtype, got {dtype!r}")
    return dtype


def compress_checkpoint(
    model_dir, output_dir, *, calibration_data, config: Optional[ConvertConfig] = None, resume: bool = False,
    distill: Optional[Distiller] = None, dtype: Optional[torch.dtype] = None, overwrite: bool = False,
    in_memory: bool = False, allow_missing_weights: bool = False, process_group=None, **options,
) -> "pd.DataFrame":
    """Convert the transformers checkpoint in ``model_dir`` (:func:`~panther_lite.convert`'s
    conversion) into ``output_dir`` without loading the model whole, so models larger than
    memory compress. Nothing is ever written into ``model_dir``.

    The model is built from its config with parameters on the meta device; what lies outside its
    block list (embeddings, final norm, head) is read from the safetensors file(s) once, each
    block only while a step runs it (the out-of-core pipeline,
    :mod:`~panther_lite.conversion.pipelines.out_of_core`); each finished block is written to the
    output before the next is read. Peak memory: the imports, the parts outside the blocks,
    about two blocks and the working buffers (Grams, the cached hidden states), whatever the
    depth. A model without a block list, calibration data that is not a list of batches, or
    blocks that are not a chain is loaded whole, with a warning saying why.

    Output: a transformers checkpoint directory (sharded safetensors with their index, one shard
    per block; ``config.json``; ``panther_lite_config.json``; the tokenizer; ``report.csv``,
    ``report.png`` and, with refinement, ``refinement.csv``) that
    :func:`~panther_lite.from_pretrained` loads: the same model as ``convert`` on the same batches.
    Everything is written to the staging directory ``.<name>.partial`` beside ``output_dir``,
    renamed into place at the end. A run stopped in any way (an error, Ctrl-C, SIGTERM, SIGKILL)
    after it planned or wrote a block leaves that directory; ``resume=True`` continues from the
    last block written, with the same result bit for bit; a directory left by another checkpoint,
    other options, other data or other versions is refused, as is one without ``resume``.

    Args:
        model_dir: a transformers ``save_pretrained`` directory with safetensors weights.
        output_dir: where to write; must not be, hold or lie inside ``model_dir``.
        calibration_data: a list of batches (``model(**batch)`` for a dict, ...) as for ``convert``.
        config: a :class:`~panther_lite.ConvertConfig` (None: its defaults), as for ``convert``.
        **options: its fields as overrides, as for ``convert``.
        resume: continue the run a staging directory holds (with none, start afresh).
        dtype: the dtype the model is loaded and converted in (None: the checkpoint's), a
            floating-point ``torch.dtype``.
        overwrite: replace a non-empty ``output_dir``.
        in_memory: load the model whole and convert it in memory.
        allow_missing_weights: a checkpoint lacking tensors the model needs is loaded whole with
            those initialised at random, named in the report's ``attrs["random_weights"]``; by
            default it is a ValueError naming them, as is one holding tensors the model does not
            place. Each flag is True or False (TypeError otherwise).
        process_group: as for ``convert`` (None: the default group when ``torch.distributed`` is
            initialised, e.g. under ``torchrun``): every process converts its share of the batches
            (streamed: each reads the blocks itself and keeps its batches' hidden states in the
            staging directory, which every process must see, for ``resume`` on any number of
            processes) and rank 0 alone writes ``output_dir``, the others waiting for it at a barrier.
        distill: None, or a callable ``(model, directory)`` run after the conversion and before
            the model is saved, e.g. one calling :func:`~panther_lite.distill` against the
            original's outputs cached beforehand, streamed from ``model_dir``
            (:func:`~panther_lite.teacher_outputs`), so the original is never in memory with it;
            ``directory`` is the staged output. The conversion streams as without it and writes
            its checkpoint into the resume directory, which is then loaded (at the compressed
            size, :func:`~panther_lite.from_pretrained`), trained and saved into the output:
            memory holds the compressed model and its training state, never the original
            whole. A run stopped while distilling resumes (``resume=True``) after the last
            block converted: the distillation alone runs again, from the converted model; or,
            given ``distill=None`` (the distillation failed, e.g. beyond the machine's memory),
            the converted model is written as it is (a conversion resumes with or without it).
            Across processes it runs on every process (``directory`` None on all but rank 0),
            each loading the checkpoint rank 0 converted, e.g. :func:`~panther_lite.distill`
            across them.

    Examples:
        >>> import tempfile, torch, transformers, panther_lite
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> source, output = tempfile.mkdtemp(), tempfile.mkdtemp() + "/out"
        >>> transformers.LlamaForCausalLM(config).save_pretrained(source)
        >>> batches = [dict(input_ids=torch.randint(0, 40, (2, 8))) for _ in range(2)]
        >>> report = panther_lite.compress_checkpoint(source, output, calibration_data=batches,
        ...     param_ratio=0.5, progress=False)
        >>> report.attrs["pipeline"].split(":")[0]
        'out of core'

    Returns:
        ``convert``'s report; ``attrs["pipeline"]`` says which pipeline ran and why.
    """
    dtype = _check_dtype(dtype)
    resume, overwrite, in_memory, allow_missing_weights = (
        check_bool(name, flag) for name, flag in (("resume", resume), ("overwrite", overwrite),
                                                  ("in_memory", in_memory), ("allow_missing_weights", allow_missing_weights))
    )
    if distill is not None and not callable(distill):
        raise TypeError(f"distill must be None or a callable (model, directory), got {type(distill).__name__}")
    config, data = conversion_options(config, options, calibration_data, caller="compress_checkpoint")
    run = resolve_run(process_group)
    arguments = (model_dir, output_dir, config, data, resume, distill, dtype, overwrite, in_memory, allow_missing_weights)
    if run is None:
        return _compress_on(None, *arguments)
    check_compress_across(run, in_memory, resume, config.output_fisher)
    with owned_copy(run) as own:  # a group a failure can take down (process_groups/failures.py)
        return _compress_on(own, *arguments)


def _compress_on(
    run, model_dir, output_dir, config: ConvertConfig, data: CalibrationData, resume: bool,
    distill: Optional[Distiller], dtype, overwrite: bool, in_memory: bool, allow_missing_weights: bool,
) -> "pd.DataFrame":
    """:func:`compress_checkpoint` on this process of ``run`` (None: one process)."""
    if run is not None and run.rank != 0:
        return _convert_elsewhere(run, model_dir, config, data, dtype, in_memory, allow_missing_weights, distill)
    with announcing(run, streamed=not in_memory) as announcement:  # across processes: the others hear how it went
        report = _compress_first(run, announcement, model_dir, output_dir, config, data, resume, distill, dtype,
                                 overwrite, in_memory, allow_missing_weights)
        if run is not None:
            run.barrier("rank 0 writing the output")
    return report


def _compress_first(
    run, announcement, model_dir, output_dir, config: ConvertConfig, data: CalibrationData, resume: bool,
    distill: Optional[Distiller], dtype, overwrite: bool, in_memory: bool, allow_missing_weights: bool,
) -> "pd.DataFrame":
    """:func:`compress_checkpoint` in one process, or on rank 0 (which alone writes the output)."""
    for name, path in (("model_dir", model_dir), ("output_dir", output_dir)):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(path).__name__}")
    files = CheckpointFiles(Path(model_dir))
    dtype = dtype or files.default_dtype()
    own = {"dtype": str(dtype), "overwrite": overwrite, "in_memory": in_memory, "allow_missing_weights": allow_missing_weights}
    fingerprint = _fingerprint(files, config, data, own)
    _check_resumable_filter(config, output_dir, resume)
    state = None
    try:
        with running_on(run), staged_directory(Path(output_dir), overwrite, {"MODEL_DIR": Path(model_dir)}, resume) as staging:
            state = RunState(staging.path, fingerprint)
            shared = announcement.ready(state)  # across processes: the state every rank sees
            try:
                with writing(staging.path):
                    report = _convert_into(files, dtype, config, data, shared, staging.path, in_memory,
                                           allow_missing_weights, distill)
            except BaseException:
                staging.keep = state.holds_work
                raise
            staging.keep = True  # the record goes into place with the output, removed once it is there
    finally:
        if state is not None:
            state.close()
    shutil.rmtree(Path(os.path.realpath(output_dir)) / RESUME_DIRECTORY, ignore_errors=True)
    return report


def _check_resumable_filter(config: ConvertConfig, output_dir, resume: bool) -> None:
    """ValueError when resuming a run whose ``filter_fn`` cannot be fingerprinted."""
    _, unfingerprinted = filter_fingerprint(config.filter_fn)
    if resume and unfingerprinted and staging_path(Path(output_dir)).exists():
        raise ValueError(
            f"cannot resume with this filter_fn: {unfingerprinted}, so whether it selects what the stopped run "
            "selected cannot be checked; pass a plain function (def or lambda), or delete "
            f"{str(staging_path(Path(output_dir)))!r} to start again"
        )
