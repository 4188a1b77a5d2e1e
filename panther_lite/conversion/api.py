"""``convert`` and ``densify``: one-call model surgery, orchestrating selection, planning,
calibration, fitting, the atomic swap, the run check and the report.

Sizes: a dense layer with ``fan_in`` inputs (``in_features``, or ``C_in·kh·kw`` for a
convolution) and ``fan_out`` outputs stores ``fan_in·fan_out`` (+ bias) parameters; its
sketched replacement stores ``2·L·k·(fan_in + fan_out)`` (+ bias), the fixed U sketch
buffers included. Every "stored" figure counts those buffers.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..nn.layer_base import INITS
from ..nn.low_rank_fit import FIT_METHODS
from ..nn.validation import check_choice, check_positive_int
from ..sketch.random import check_seed
from .block_pipeline import choose_blocks, convert_by_blocks, plan_global_by_blocks
from .block_refinement import BlockRefiner, check_refine
from .blocks import BlockCall, BlockList, capture_inputs
from .calibration import (
    Calibration, check_calibration_data, check_calibration_device, collect_grams, reiterable, run_batch,
)
from .fitting import check_finite_weights
from .layer_fits import fit_planned
from .kinds import SKETCHED_TYPES, dense_kind_of
from .layer_record import LayerRecord
from .planning import (
    ALLOCATIONS, PlanNote, RankSpec, SizeRequest, parse_sizes, plan_global, plan_sizes, pooled_records, rank_multiple_for,
)
from .report import build_report
from .selection import ModuleFilter, ModuleSelector, check_filter, check_selector, mark_unconvertible, select_layers
from .sensitivity import output_gains
from .sequential import check_sequential_data
from .speed import keep_slower_layers_dense
from .surgery import SwapLog, restores_buffers_on_error, stored_numel, swap_modules, undo_swaps
from .verification import check_converted_model_runs

if TYPE_CHECKING:
    import pandas as pd


def _plan(
    model: nn.Module, records: List[LayerRecord], sizes: SizeRequest, options: dict,
    block_list: Optional[BlockList] = None, calls: Optional[List[BlockCall]] = None,
) -> Tuple[Dict[str, PlanNote], Optional[Calibration]]:
    """Size the records (uniformly or from one global budget) and record the Grams the
    non-sequential fits need; a global plan reads every pooled layer's spectrum first
    (block by block from the first block's cached ``calls`` when a ``block_list`` is given;
    the block pipeline records its Grams itself)."""
    multiple_of = rank_multiple_for(options["align"])
    pooled = pooled_records(records, sizes, options["allocation"])
    notes = plan_sizes(records, sizes, multiple_of, pooled={record.name for record in pooled})
    candidates = [record for record in records if record.to_convert]
    check_finite_weights(candidates)
    if block_list is not None:
        if pooled:
            notes.update(plan_global_by_blocks(model, pooled, block_list, calls, sizes, multiple_of, options))
        return notes, None
    data, sequential = options["calibration_data"], options["sequential"]
    calibration = None
    if data is not None and candidates and (pooled or not sequential):
        calibration = collect_grams(model, candidates, data, options["progress"], options["calibration_device"])
    if pooled:
        grams = {r.name: None if calibration is None else calibration.recorders[r.name].fit_gram() for r in pooled}
        replay = None if calibration is None else calibration.replay
        gains = {} if replay is None else output_gains(model, pooled, replay)
        notes.update(plan_global(pooled, sizes.default, sizes.ratio_terms, multiple_of, grams, gains))
    if calibration is not None:
        for record in candidates:
            if sequential or not record.to_convert:
                calibration.release(record.name)
    return notes, calibration


def _check_options(options: dict) -> None:
    """Validate the arguments not tied to sizes or selection (nothing has changed yet)."""
    check_choice("init", options["init"], INITS)
    check_choice("allocation", options["allocation"], ALLOCATIONS)
    check_choice("fit", options["fit"], FIT_METHODS)
    if not isinstance(options["sequential"], bool):
        raise TypeError(f"sequential must be True or False, got {options['sequential']!r}")
    options["seed"] = check_seed(options["seed"])
    check_calibration_data(options["calibration_data"])
    options["calibration_device"] = check_calibration_device(options["calibration_device"])
    if options["sequential"]:
        if options["init"] != "svd":
            raise ValueError("sequential=True fits each layer to the original outputs, which needs init='svd'")
        check_sequential_data(options["calibration_data"])
    rank_multiple_for(options["align"])
    if options["runtime_rows"] is not None:
        options["runtime_rows"] = check_positive_int("runtime_rows", options["runtime_rows"])
    options["refine"] = check_refine(options["refine"])


def _add_plan_columns(report: "pd.DataFrame", notes: Dict[str, PlanNote], options: dict) -> None:
    """The planner's columns: ``rank_multiple`` (the multiple ``low_rank`` was rounded to, 1
    for none; only for ratio-sized converted layers) and ``budget_share`` (global allocation:
    the layer's stored entries over the budget, kept-dense layers included)."""
    import pandas as pd

    converted = report["status"] == "converted"
    multiples = [notes[n].rank_multiple if n in notes else pd.NA for n in report["name"]]
    report["rank_multiple"] = pd.Series(multiples, index=report.index, dtype="Int64").where(converted, pd.NA)
    report["budget_share"] = [notes[n].budget_share if n in notes else float("nan") for n in report["name"]]
    report.attrs["allocation"] = options["allocation"]


def convert(
    model: nn.Module,
    *,
    target_modules: ModuleSelector = None,
    exclude_modules: ModuleSelector = None,
    filter_fn: Optional[ModuleFilter] = None,
    num_terms: Optional[int] = None,
    low_rank: Optional[int] = None,
    param_ratio: Optional[float] = None,
    rank_pattern: Optional[Mapping[str, RankSpec]] = None,
    init: str = "svd",
    calibration_data=None,
    calibration_device: Union[str, torch.device, None] = None,
    example_inputs=None,
    seed: Optional[int] = None,
    progress: Optional[bool] = None,
    allocation: str = "uniform",
    sequential: bool = False,
    align: Union[None, str, int] = "auto",
    fit: str = "auto",
    runtime_rows: Optional[int] = None,
    blocks: Union[None, bool, str] = "auto",
    refine: Union[bool, Mapping[str, float], None] = False,
) -> "pd.DataFrame":
    """Replace linear and convolution layers of ``model`` with fitted sketched layers, in place.

    Candidates: ``nn.Linear`` and transformers' ``Conv1D`` (→ :class:`~panther_lite.nn.SKLinear`),
    ``nn.Conv1d``/``2d``/``3d`` (→ ``SKConv1d``/``2d``/``3d``). Everything is validated,
    calibrated and fitted before the first swap: on any error the model is left as it was.
    The conversion workflow in the docs (``docs/workflows.rst``) details each rule.

    Args:
        target_modules: PEFT's semantics: None (every candidate), ``"all-linear"``, a regex
            full-matched against the dotted name, or a list of names or dotted suffixes
            (an entry matching no candidate is a ValueError naming it).
        exclude_modules: same semantics; wins over ``target_modules``.
        filter_fn: ``(module, fqn) -> bool``; a module converts only if it returns True.
        num_terms, low_rank: ``L`` and ``k`` for every layer (with ``param_ratio``,
            ``num_terms`` fixes ``L``, default 1).
        param_ratio: stored size (U buffers included) as a fraction of the dense size, in
            (0, 1]: of each layer (``allocation="uniform"``: the largest ``low_rank`` that
            fits, so a layer stores at most it and, where a rank step allows, at least 90%)
            or of all the layers it sizes together (``"global"``).
        rank_pattern: ``{regex: ratio or (num_terms, low_rank)}`` per layer, first match wins.
        init: ``"svd"``: the best rank-``2Lk`` fit of each weight, or with calibration data
            of each layer's outputs (whitened SVD); ``"sketch"``: the anchor's estimate.
        calibration_data: iterable of batches (Tensor → ``model(b)``, tuple → ``model(*b)``,
            dict → ``model(**b)``) or ``fn(model)``, run in eval mode under no_grad while
            hooks accumulate each layer's float64 input Gram (``8·Σ fan_in²`` bytes).
        calibration_device: where the Grams live (None: each layer's device; not "meta").
        example_inputs: a batch (same forms) the converted model is run on once; without
            it, the first calibration batch is. If that run fails, every swap is undone and
            :class:`~panther_lite.conversion.ConversionError` names the layer involved.
        seed: makes ``init="sketch"`` reproducible (layer ``i`` uses ``seed + i``).
        progress: tqdm bars; None shows them on a terminal only.
        allocation: ``"uniform"`` (``param_ratio`` per layer) or ``"global"``: one budget
            for every layer the default ``param_ratio`` sizes, spent where it lowers the summed
            relative squared output error most, predicted from each layer's whitened singular
            spectrum (activation-aware with calibration data, the weight's own without; see
            :mod:`~panther_lite.conversion.allocation`) and weighted, with calibration data, by
            the layer's measured gain to the model's output (:mod:`~panther_lite.conversion.sensitivity`);
            a layer no sketch beats, or whose budget buys more elsewhere, stays dense with the reason.
        sequential: with ``calibration_data`` given as a list of batches, a DataLoader or a
            deterministic callable (run again, layer calls paired by order), fit the layers
            in model order on the partly converted model, each to reproduce
            the original layer's outputs from the inputs it now receives (reduced-rank
            regression, :mod:`~panther_lite.conversion.sequential`): one group of layers'
            statistics alive at a time; the batches run twice per group.
        align: ``low_rank`` rounding for tensor cores: ``"auto"`` rounds to the dtype's
            multiple (8 for fp16/bf16, 4 for TF32) only for CUDA layers in a tensor-core
            dtype; None never; an int to that multiple. Never where it would leave more than
            10% of a layer's budget unused.
        fit: ``"auto"``, ``"exact"`` or ``"randomized"``: the fits' decomposition
            (:mod:`panther_lite.nn.low_rank_fit`; "auto" is randomized on wide layers).
        runtime_rows: the rows per call the model will run at (batch × tokens; batch ×
            output positions for convolutions). With it, a layer whose sketch a FLOP plus
            per-call-overhead model (:mod:`~panther_lite.conversion.speed`) predicts slower
            than dense at that size stays dense with the modelled times as the reason.
        blocks: convert block by block (:mod:`~panther_lite.conversion.block_pipeline`):
            ``"auto"`` (or None) finds the repeated block list (the longest ``nn.ModuleList``
            of two or more same-class children holding a layer to convert: ``model.layers``,
            ``transformer.h``, ``encoder.layer``, ...), a dotted path names it, False never.
            It needs calibration data given as re-iterable batches; otherwise, or without a
            block list, the whole model is calibrated at once. ``attrs["pipeline"]`` says which ran.
        refine: block-wise refinement (needs the block pipeline): after each block's
            closed-form fits, Adam on the factors and biases of the layers this call fitted in
            it (earlier conversions' sketched layers untouched) so the converted
            block reproduces the original block's outputs on the cached calibration inputs,
            stopping early on held-back calls and keeping the best parameters seen there
            (:func:`~panther_lite.conversion.refinement.refine_block`; in float32 for a
            half-precision block). True (or ``{}``) for the defaults — ``max_steps=100``,
            ``lr=1e-3``, ``holdout=0.25`` of the batches, ``patience=10`` — or a dict of some.
            ``attrs["refinement"]``: per block, the held-back output error before and after;
            a refined layer reads ``init="...+refined"`` (its ``weight_error`` measured
            again, its ``output_error`` the closed-form fit's).

    Returns:
        A DataFrame, one row per selected layer (``REPORT_COLUMNS``): ``status``
        (``"converted"``, ``"kept dense"`` or ``"skipped"``) with its ``reason``, sizes
        (``stored_params`` counts the U buffers), ``weight_error`` ``‖Ŵ − W‖_F/‖W‖_F``,
        ``output_error`` ``‖X(W − Ŵ)ᵀ‖_F/‖XWᵀ‖_F`` on the calibration data (else NaN);
        ``attrs["summary"]`` is :func:`~panther_lite.conversion.conversion_summary`'s line.
        ``rank_multiple``: what ``low_rank`` was rounded to (1: none); ``budget_share``
        (global allocation): the layer's stored entries over the budget. Layers fitted
        sequentially read ``init="sequential"``. Identical inputs (q/k/v) share one Gram
        and each Gram is freed once its layers are fitted.

    Raises:
        TypeError / ValueError naming the argument, or the layer (inf/NaN weights or
        calibration inputs, a batch that does not fit it); ConversionError (see above).
        After any error the model holds its original modules, weights and buffers (a
        forward that changed buffers during calibration, e.g. BatchNorm statistics of a
        model that switches itself to training, has them put back).
    """
    report, _ = _convert(**locals())  # every argument, by name
    return report


def convert_undoable(model: nn.Module, **kwargs) -> Tuple["pd.DataFrame", SwapLog]:
    """:func:`convert` (same arguments), also returning the swap log that
    :func:`~panther_lite.conversion.surgery.undo_swaps` reverts (``tune`` tries budgets so)."""
    bound = inspect.signature(convert).bind(model, **kwargs)
    bound.apply_defaults()
    return _convert(**bound.arguments)


@restores_buffers_on_error
def _convert(model: nn.Module, **options) -> Tuple["pd.DataFrame", SwapLog]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_selector("target_modules", options["target_modules"])
    check_selector("exclude_modules", options["exclude_modules"])
    check_filter(options["filter_fn"])
    _check_options(options)
    sizes = parse_sizes(options["num_terms"], options["low_rank"], options["param_ratio"], options["rank_pattern"])

    records = select_layers(model, options["target_modules"], options["exclude_modules"], options["filter_fn"])
    mark_unconvertible(model, records)
    block_list, pipeline = choose_blocks(model, records, options)
    if options["refine"] is not None and block_list is None:
        raise ValueError(f"refine refines block by block, but this convert runs on the {pipeline}")
    calls = None
    if block_list is not None:
        cache_device = options["calibration_device"] or torch.device("cpu")
        calls = capture_inputs(model, block_list, options["calibration_data"], cache_device, options["progress"])
    notes, calibration = _plan(model, records, sizes, options, block_list, calls)
    keep_slower_layers_dense(records, options["runtime_rows"])
    todo = [record for record in records if record.to_convert]

    stored_before = stored_numel(model)
    refiner = None if options["refine"] is None else BlockRefiner(options["refine"])
    if block_list is None:
        fits = fit_planned(model, todo, calibration, options)
        log = swap_modules(model, [(name, fit.module) for name, fit in fits.items()])
    else:
        fits, log = convert_by_blocks(model, todo, block_list, calls, options, refiner)
    new_modules = {name: fit.module for name, fit in fits.items()}
    try:
        _check_runs(model, new_modules, options["example_inputs"], _replay(calibration, options))
    except BaseException:
        undo_swaps(log)
        raise
    report = build_report(records, fits, stored_before, stored_numel(model))
    _add_plan_columns(report, notes, options)
    report.attrs["pipeline"] = pipeline
    if refiner is not None:
        report.attrs["refinement"] = refiner.results
    return report, log


def _replay(calibration: Optional[Calibration], options: dict):
    """What runs the converted model once: the calibration replay, or (sequential fits and
    the block pipeline record no Calibration) the first calibration batch; a callable
    calibration ``fn`` is run again."""
    if calibration is not None:
        return calibration.replay
    data = options["calibration_data"]
    if callable(data):
        return data
    if data is None or not reiterable(data):
        return None
    first = next(iter(data), None)
    return None if first is None else (lambda model: run_batch(model, first))


def _check_runs(model: nn.Module, new_modules: Dict[str, nn.Module], example_inputs, replay) -> None:
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
    place: ``to_dense()`` (same function, device, dtype, training mode and
    ``requires_grad``), or for an SKLinear converted from transformers' ``Conv1D`` a
    ``Conv1D`` again (``(in, out)`` weight; an ``nn.Linear`` when transformers cannot be
    imported). Returns ``model``, or the dense layer itself when ``model`` is a sketched
    layer (a root cannot be replaced in place)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, SKETCHED_TYPES):
        return _dense_twin(model)
    sketched = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, SKETCHED_TYPES)]
    swap_modules(model, [(fqn, _dense_twin(m)) for fqn, m in sketched])
    return model


def _dense_twin(layer: nn.Module) -> nn.Module:
    """The dense layer ``layer`` stands for, with its training mode and requires_grad."""
    dense = dense_kind_of(layer).dense_twin(layer)
    dense.train(layer.training)
    factor = next(param for name, param in layer.named_parameters() if name != "bias")
    dense.weight.requires_grad_(factor.requires_grad)
    if layer.bias is not None:
        dense.bias.requires_grad_(layer.bias.requires_grad)
    return dense
