"""The convert workflow: ``convert`` and ``densify``, one-call model surgery — config → selection → pipeline (plan,
fit and swap) → run check → report.

Sizes: a dense layer with ``fan_in`` inputs (``in_features``, or ``C_in·kh·kw`` for a
convolution) and ``fan_out`` outputs stores ``fan_in·fan_out`` (+ bias) parameters; its
sketched replacement stores ``2·L·k·(fan_in + fan_out)`` (+ bias), the fixed U sketch
buffers included. Every "stored" figure counts those buffers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch.nn as nn

from ..calibration.batches import ModelRun, run_batch
from ..config import ConvertConfig
from ..process_groups.run import distributed_conversion
from ..kinds import converted_kind, sketched_types
from ..pipelines.base import Conversion, Pipeline
from ..pipelines.choice import choose_pipeline
from ..planning.sizes import PlanNote
from ..planning.speed import keep_slower_layers_dense
from ..report import build_report
from ..saving.hf_recording import forget_conversion_on_save, record_conversion_on_save
from ..selection import frozen_layers, name_preview
from ..surgery import SwapLog, restores_buffers_on_error, stored_numel, swap_modules, undo_swaps
from ..verification import check_converted_model_runs
from .setup import conversion_job, conversion_options

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["convert", "convert_undoable", "densify", "run_pipeline"]


def convert(
    model: nn.Module,
    config: Optional[ConvertConfig] = None,
    *,
    calibration_data=None,
    example_inputs=None,
    process_group=None,
    **overrides,
) -> "pd.DataFrame":
    """Replace linear and convolution layers of ``model`` with fitted sketched layers, in place.

    Candidates: every registered layer kind (:func:`~panther_lite.register_kind`):
    ``nn.Linear`` and transformers' ``Conv1D`` (→ :class:`~panther_lite.nn.SKLinear`),
    ``nn.Conv1d``/``2d``/``3d`` (→ ``SKConv1d``/``2d``/``3d``). Everything is validated,
    calibrated and fitted before the first swap: on any error the model is left as it was.
    The conversion workflow in the docs (``docs/workflows.rst``) details each rule.
    A transformers model (or one inside ``model``) then records its conversion whenever it is
    saved, by :func:`~panther_lite.save_pretrained` or by its own ``save_pretrained``:
    ``AutoModel*.from_pretrained`` of that directory builds the sketched layers after
    ``import panther_lite`` and fails loudly without it (``docs/huggingface.rst``).

    Args:
        config: a :class:`~panther_lite.ConvertConfig` holding the options (sizes, selection,
            allocation, fits, pipeline); None for its defaults.
        calibration_data: iterable of batches (Tensor → ``model(b)``, tuple → ``model(*b)``,
            dict → ``model(**b)``) or ``fn(model)``, run in eval mode under no_grad while
            hooks accumulate each layer's float64 input Gram (``8·Σ fan_in²`` bytes).
        example_inputs: a batch (same forms) the converted model is run on once; without
            it, the first calibration batch is. If that run fails, every swap is undone and
            :class:`~panther_lite.conversion.ConversionError` names the layer involved.
        process_group: the ``torch.distributed`` group to convert across (None: the default group
            when ``torch.distributed`` is initialised, e.g. under ``torchrun``): each process runs
            its share of the batches (batch ``i`` on rank ``i % world``), the statistics are summed
            across processes and every process fits the same model (``docs/large_models.rst``).
        **overrides: :class:`~panther_lite.ConvertConfig` fields (``param_ratio=0.5``,
            ``allocation="global"``, ...), replacing the ``config``'s
            (``dataclasses.replace(config, **overrides)``); the same options as keywords or
            in a config give the same model bit for bit. An unknown name is a TypeError
            naming the closest option.

        Examples:
        >>> import torch, torch.nn as nn, panther_lite
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> batches = [torch.randn(32, 64) for _ in range(2)]
        >>> report = panther_lite.convert(model, param_ratio=0.5, calibration_data=batches, progress=False)
        >>> list(report["status"]), type(model[0]).__name__
        (['converted', 'converted'], 'SKLinear')
        >>> config = panther_lite.ConvertConfig(param_ratio=0.5, allocation="global")  # the same options, kept

    Returns:
        A DataFrame, one row per selected layer (``REPORT_COLUMNS``): ``status``
        (``"converted"``, ``"kept dense"`` or ``"skipped"``) with its ``reason``, sizes
        (``stored_params`` counts the U buffers), ``weight_error`` ``‖Ŵ − W‖_F/‖W‖_F``,
        ``output_error`` ``‖X(W − Ŵ)ᵀ‖_F/‖XWᵀ‖_F`` on the calibration data (else NaN);
        ``attrs["summary"]`` is :func:`~panther_lite.conversion.conversion_summary`'s line,
        ``attrs["pipeline"]`` the pipeline that ran and why, ``attrs["config"]`` the config.
        ``rank_multiple``: what ``low_rank`` was rounded to (1: none); ``budget_share``
        (global allocation): the layer's stored entries over the budget. Layers fitted
        sequentially read ``init="sequential"``. Identical inputs (q/k/v) share one Gram
        and each Gram is freed once its layers are fitted.

    Raises:
        TypeError / ValueError naming the option, or the layer (inf/NaN weights or
        calibration inputs, a batch that does not fit it); ConversionError (see above).
        After any error the model holds its original modules, weights and buffers (a
        forward that changed buffers during calibration, e.g. BatchNorm statistics of a
        model that switches itself to training, has them put back).
    """
    report, _ = convert_undoable(
        model, config, calibration_data=calibration_data, example_inputs=example_inputs, process_group=process_group,
        **overrides,
    )
    return report


@restores_buffers_on_error
def convert_undoable(
    model: nn.Module, config: Optional[ConvertConfig] = None, *, calibration_data=None, example_inputs=None,
    process_group=None, **overrides,
) -> Tuple["pd.DataFrame", SwapLog]:
    """:func:`convert` (same arguments), also returning the swap log that
    :func:`~panther_lite.conversion.surgery.undo_swaps` reverts (``tune`` tries budgets so)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    config, data = conversion_options(config, overrides, calibration_data)
    with distributed_conversion(process_group, config, data) as data:  # this rank's batches
        job = conversion_job(model, config, data)
        return run_pipeline(job, choose_pipeline(job), example_inputs)


def run_pipeline(job: Conversion, pipeline: Pipeline, example_inputs=None) -> Tuple["pd.DataFrame", SwapLog]:
    """Carry out ``job`` on ``pipeline``: plan, keep layers too slow to pay dense, fit and swap,
    run the converted model once (undoing every swap if it fails), and report."""
    notes = pipeline.plan(job)
    keep_slower_layers_dense(job.records, job.config.runtime_rows)
    stored_before = stored_numel(job.model)
    fits, log = pipeline.fit(job)
    new_modules = {name: fit.module for name, fit in fits.items()}
    try:
        _check_runs(job.model, new_modules, example_inputs, pipeline.replay(job))
    except BaseException:
        undo_swaps(log)
        raise
    record_conversion_on_save(job.model)  # transformers' own save_pretrained records it too
    report = build_report(job.records, fits, stored_before, stored_numel(job.model))
    _add_plan_columns(report, notes, job.config)
    report.attrs["pipeline"] = pipeline.description
    report.attrs.update(pipeline.report_attrs())
    report.attrs["config"] = job.config
    return report, log


def _add_plan_columns(report: "pd.DataFrame", notes: Dict[str, PlanNote], config: ConvertConfig) -> None:
    """The planner's columns: ``rank_multiple`` (the multiple ``low_rank`` was rounded to, 1
    for none; only for ratio-sized converted layers) and ``budget_share`` (global allocation:
    the layer's stored entries over the budget, kept-dense layers included)."""
    import pandas as pd

    converted = report["status"] == "converted"
    multiples = [notes[n].rank_multiple if n in notes else pd.NA for n in report["name"]]
    report["rank_multiple"] = pd.Series(multiples, index=report.index, dtype="Int64").where(converted, pd.NA)
    report["budget_share"] = [notes[n].budget_share if n in notes else float("nan") for n in report["name"]]
    report.attrs["allocation"] = config.allocation


def _check_runs(model: nn.Module, new_modules: Dict[str, nn.Module], example_inputs, replay: Optional[ModelRun]):
    """Run the converted model once on ``example_inputs``, else on the calibration replay
    (nothing to run, or nothing converted: no check)."""
    if not new_modules:
        return
    if example_inputs is not None:
        check_converted_model_runs(model, lambda m: run_batch(m, example_inputs), new_modules, "example_inputs")
    elif replay is not None:
        check_converted_model_runs(model, replay, new_modules, "the first calibration batch")


def densify(model: nn.Module) -> nn.Module:
    """Replace every sketched layer in ``model`` with the dense layer it stands for, in
    place: its kind's dense twin (``to_dense()``: same function, device, dtype, training
    mode and ``requires_grad``; for an SKLinear converted from transformers' ``Conv1D`` a
    ``Conv1D`` again, ``(in, out)`` weight, or an ``nn.Linear`` when transformers cannot be
    imported). Returns ``model``, or the dense layer itself when ``model`` is a sketched
    layer (a root cannot be replaced in place). A transformers model no longer records a
    conversion when it is saved (what :func:`convert` or the plugin's loading attached is
    removed): its ``save_pretrained`` writes a plain dense checkpoint. A model holding frozen layers
    (:func:`~panther_lite.freeze`, one-way) is a ValueError, nothing changed.

    Examples:
        >>> import torch.nn as nn, panther_lite
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> _ = panther_lite.convert(model, num_terms=1, low_rank=2, progress=False)
        >>> type(panther_lite.densify(model)[0]).__name__
        'Linear'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    frozen = frozen_layers(model)
    if frozen:
        raise ValueError(
            f"densify: the model holds {len(frozen)} frozen layers ({name_preview(frozen, limit=3)}); freeze is "
            "one-way (the sketches are folded into standard layers): densify the model before freezing it"
        )
    if isinstance(model, sketched_types()):
        return _dense_twin(model)
    sketched = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, sketched_types())]
    swap_modules(model, [(fqn, _dense_twin(m)) for fqn, m in sketched])
    forget_conversion_on_save(model)  # it saves as the plain dense model again
    return model


def _dense_twin(layer: nn.Module) -> nn.Module:
    kind, _ = converted_kind(layer)
    return kind.densify(layer)
