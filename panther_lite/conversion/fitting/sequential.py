"""Sequential calibration: fit layers in model order on the partly converted model, each to
reproduce the *original* layer's outputs from the inputs it now receives.

For a layer with weight ``W`` (``fan_out × fan_in``), original inputs ``X`` (rows, from the
dense model) and current inputs ``X̃`` (from the model whose earlier layers are already
replaced), the fit minimises ``‖X̃ Ŵᵀ − X Wᵀ‖_F`` over rank-``2Lk`` ``Ŵ``: a reduced-rank
regression. With ``G̃ = X̃ᵀX̃`` and the cross statistic ``C = X̃ᵀX``, the least-squares map
``T`` solves ``(G̃_α + λI) Tᵀ = (C_α + λI) Wᵀ``, where ``G̃_α``, ``C_α`` have their
off-diagonal entries shrunk by the strength ``α`` the config's ``shrinkage``
gives the fit whitened by ``G̃`` (:mod:`~panther_lite.conversion.calibration.shrinkage`; at
``α = 1`` each input is regressed on its own) and a small ridge ``λ`` = :data:`RIDGE` · mean
diag ``G̃`` pulls ``T`` towards ``W`` where the inputs barely reach; and
``‖X̃ Ŵᵀ − X Wᵀ‖² = ‖X̃ (Ŵ − T)ᵀ‖² + const``, so the best ``Ŵ`` is the activation-aware fit of ``T`` whitened by ``G̃`` (``G̃_α`` as for the layers' own fit).
The upstream error is corrected instead of ignored (``T = W`` when ``X̃ = X``).

Calibration data is a list of batches or a DataLoader (each batch runs through the original
and then the partly converted model), or a deterministic callable ``fn(model)`` (e.g.
``lambda m: m.encode(texts)`` for sentence-transformers), called once for each of the two
runs; a layer's calls are paired by their order within a batch or a call of ``fn``. The first
group checks the pairing: nothing upstream of it is converted, so both runs must give it the
same inputs, and a ValueError says so when they do not (a callable that samples or reorders).

Layers run in the order of their first call; layers whose inputs are the very same tensor
(q/k/v projections of one hidden state) form one *group* sharing one set of statistics. Each
group costs two runs of the calibration batches (the original model, then the partly converted
one, paired batch by batch) and holds three ``fan_in²`` float64 matrices (``G̃``, ``C`` and
``G = XᵀX`` for the reported error), freed as soon as the group is fitted: peak memory is one
group's statistics, not the whole model's. Each run stops as soon as the group's layers
have had as many calls as on the first batch (the rest of the forward cannot matter), which
assumes every batch calls the layers equally often.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.low_rank_fit import relative_error
from ..calibration.batches import evaluation_run, run_batch_or_callable
from ..calibration.grams import CallOrder, check_finite_inputs, group_layers
from ..calibration.shrinkage import HeldBack, RowMoments, any_checked, layer_strength, note_calibration, shrink
from ..calibration.tokens import LayerRows, layer_rows
from ..process_groups.statistics import agree_any, reduce_group_statistics, reduce_recorders
from ..records import LayerRecord
from ..progress import progress_bar
from ..surgery import swap_modules, undo_swaps
from .across import fit_split
from .layer import FitResult, built_weight, check_built, layer_seed

RIDGE = 1e-2
"""Ridge of the regression, relative to the mean diagonal of ``G̃``: it pulls ``T`` towards
``W`` (not towards 0) where the calibration inputs barely reach, and leaves ``T = W`` exactly
when ``X̃ = X``. The shrinkage does not replace it: on MiniLM calibrated on 54 sentences a
ridge of 1e-4 instead lost 0.03 of cosine out of domain."""


def _rows(record: LayerRecord, module: nn.Module, x: Tensor) -> Tuple[Tensor, LayerRows]:
    """The layer's input as rows ``(n, fan_in)`` in float64 (as its kind reads them, padded
    tokens zeroed: :func:`~panther_lite.conversion.calibration.tokens.layer_rows`) and how
    they were read (rows per cluster, real rows per cluster)."""
    found = layer_rows(record.kind, module, x.detach())
    chunks = found.chunks
    rows = chunks[0][0] if len(chunks) == 1 else torch.cat([rows for rows, _ in chunks])
    return rows.double(), found


# Relative difference below which the inputs of two runs count as the same (float rounding).
_SAME_INPUT_TOLERANCE = 1e-5


class _GroupStatistics:
    """Forward pre-hooks on one group's modules. In the ``"original"`` phase the leader queues
    its inputs; in the ``"converted"`` phase each call is paired with the queued input of the
    same call and ``G̃ = X̃ᵀX̃``, ``C = X̃ᵀX`` and ``G = XᵀX`` accumulate. ``shared`` turns
    False when a member's input was not the leader's (the group must then be split)."""

    def __init__(self, group: List[LayerRecord], device: Optional[torch.device], held_back: bool = False) -> None:
        self.group, self.leader = group, group[0]
        device = self.leader.device if device is None else device
        fan_in = self.leader.fan_in
        self.current, self.cross, self.original = (
            torch.zeros(fan_in, fan_in, dtype=torch.float64, device=device) for _ in range(3)
        )
        self.moments = RowMoments()  # of the current rows X̃, for the shrinkage
        self.held = HeldBack.empty(fan_in, device) if held_back and any_checked(group) else None  # its held-back half ("auto")
        self.unaligned = False  # inputs that did not line up with an active token mask
        self.queue: deque = deque()
        self.phase, self.last_input, self.shared = "original", None, True
        self.nothing_upstream = False  # set while recording a group no fitted layer precedes

    def hook(self, record: LayerRecord) -> Callable:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = record.kind.read_input(record.name, module, args, kwargs)
            if record is not self.leader:
                self.shared = self.shared and x is self.last_input
                return
            self.last_input = x
            if self.phase == "original":
                self.queue.append(x.detach())
                return
            if not self.queue:
                raise ValueError(
                    f"sequential calibration: layer {record.name!r} was called more often in the partly converted "
                    "model than in the original on the same batch; fit this model with sequential=False"
                )
            original, _ = _rows(record, module, self.queue.popleft())
            current, found = _rows(record, module, x)
            self.check_pairing(record, original, current)
            target = self.current.device
            self.current.add_((current.t() @ current).to(target))
            self.cross.add_((current.t() @ original).to(target))
            self.original.add_((original.t() @ original).to(target))
            per_cluster, real = found.chunks[0][1], found.real[0] if len(found.real) == 1 else None
            self.moments.add(current, per_cluster, real)
            if self.held is not None:
                self.held.add(current, per_cluster, real)
            self.unaligned = self.unaligned or found.unaligned

        return pre_hook

    def check_pairing(self, record: LayerRecord, original: Tensor, current: Tensor) -> None:
        """ValueError when paired calls cannot be the same call: different shapes or, with
        nothing converted upstream (``nothing_upstream``), different inputs."""
        if original.shape != current.shape:
            raise ValueError(
                f"sequential calibration: layer {record.name!r} received inputs of different shapes in the "
                f"original and the partly converted model ({tuple(original.shape)} vs {tuple(current.shape)}); "
                "a calibration callable must make the same calls in the same order each time"
            )
        if self.nothing_upstream and (original - current).norm() > _SAME_INPUT_TOLERANCE * original.norm():
            raise ValueError(
                f"sequential calibration: two runs of the calibration data gave layer {record.name!r} different "
                "inputs although nothing before it was converted, so their calls cannot be paired; the calibration "
                "data must be deterministic (a callable with no sampling or reordering), or fit this model with "
                "sequential=False"
            )


class _GroupDone(Exception):
    """Raised by the last call of a group's layers: the rest of the forward is not needed."""


class _StopAfterGroup:
    """Forward hooks ending a run once every layer of the group had all its calls of a batch."""

    def __init__(self, group: List[LayerRecord], calls: Dict[str, int]) -> None:
        self.expected = {record.name: calls[record.name] for record in group}
        self.seen: Dict[str, int] = {}

    def hook(self, record: LayerRecord) -> Callable:
        def forward_hook(module: nn.Module, args: tuple, output) -> None:
            self.seen[record.name] = self.seen.get(record.name, 0) + 1
            if all(self.seen.get(name, 0) >= count for name, count in self.expected.items()):
                raise _GroupDone

        return forward_hook

    def run(self, model: nn.Module, batch, index: int) -> None:
        self.seen = {}
        try:
            run_batch_or_callable(model, batch, index)
        except _GroupDone:
            pass


def _record_group(
    model: nn.Module, stats: _GroupStatistics, batches, fitted: Dict[str, nn.Module], calls: Dict[str, int],
    converted_batches=None,
) -> None:
    """Run every batch through the original model, then its paired converted batch (default:
    the same) through the partly converted one, each run stopped once the group's layers are done."""
    stop = _StopAfterGroup(stats.group, calls)
    stats.nothing_upstream = not fitted and converted_batches is None
    handles = [r.module.register_forward_pre_hook(stats.hook(r), with_kwargs=True) for r in stats.group]
    handles += [r.module.register_forward_hook(stop.hook(r)) for r in stats.group]
    try:
        with evaluation_run(model):
            paired = batches if converted_batches is None else converted_batches
            for index, (batch, converted) in enumerate(zip(batches, paired)):
                stats.phase = "original"
                stop.run(model, batch, index)
                stats.phase, stats.last_input = "converted", None
                log = swap_modules(model, list(fitted.items()))
                try:
                    stop.run(model, converted, index)
                finally:
                    undo_swaps(log)
                if stats.queue:
                    raise ValueError(
                        f"sequential calibration: layer {stats.leader.name!r} was called fewer times in the partly "
                        "converted model than in the original on the same batch, so its calls cannot be paired; "
                        "the calibration data must be deterministic, or fit this model with sequential=False"
                    )
                check_finite_inputs(stats.leader.name, index, [stats.current, stats.original])
    finally:
        for handle in handles:
            handle.remove()


def _fit_member(record: LayerRecord, stats: _GroupStatistics, seed: Optional[int], fit: str, shrinkage) -> FitResult:
    """The sketched layer fitted to the original outputs (see the module docstring), its
    statistics shrunk as ``shrinkage`` (the config's) says for its fit whitened by ``G̃``, its
    output error weighed by the record's ``output_gram`` when it has one."""
    weight = record.weight_matrix().detach()
    w = weight.to(stats.current)
    intensity = layer_strength(shrinkage, weight, record.rank, stats.current, stats.moments, stats.held)
    note_calibration(record, stats.moments.rows, intensity, stats.unaligned, shrinkage)
    current = shrink(stats.current, intensity)
    ridge = RIDGE * stats.current.diagonal().mean().clamp_min(torch.finfo(torch.float64).tiny)
    eye = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
    target = torch.linalg.solve(current + ridge * eye, (shrink(stats.cross, intensity) + ridge * eye) @ w.t()).t()
    new = check_built(record, record.kind.build(record.module, record.num_terms, record.low_rank, init="sketch",
                                               seed=seed))
    record.kind.match_trainability(new, record.module)
    new.initialize_from_weight(target.reshape(new.dense_weight_shape).to(weight.dtype), "svd", current, fit=fit,
                               output_gram=record.output_gram)
    del current
    approx = built_weight(record, new, weight)
    a = approx.to(w)
    reference = float(((w @ stats.original) * w).sum())
    squared = float(((a @ stats.current) * a).sum() - 2 * ((a @ stats.cross) * w).sum()) + reference
    counts = new.parameter_counts()
    return FitResult(
        module=new,
        init="sequential",
        trainable_params=counts.trainable,
        stored_params=counts.stored,
        weight_error=relative_error(approx, weight),
        output_error=math.sqrt(max(squared, 0.0) / reference) if reference > 0 else math.nan,
        calibration_rows=stats.moments.rows,
        shrinkage=intensity,
    )


@dataclass
class _Run:
    """One sequential fit's settings: the batches (and the partly converted model's, None: the
    same), the layers' calls per batch, their seeds, where statistics live, the decomposition,
    the modules fitted before (swapped in with the new fits) and the shrinkage setting."""

    batches: list
    converted_batches: Optional[list]
    calls: Dict[str, int]
    seeds: Dict[str, Optional[int]]
    device: Optional[torch.device]
    fit: str
    prefitted: Dict[str, nn.Module]
    shrinkage: object = "auto"


def _fit_on_current_inputs(model: nn.Module, record: LayerRecord, fits: Dict[str, FitResult], run: _Run) -> FitResult:
    """A layer whose kind cannot be regressed on the original outputs (several weight matrices,
    :attr:`~panther_lite.conversion.kinds.LayerKind.sequential_regression`): its own statistics
    recorded on the inputs the partly converted model gives it, then its kind's fit."""
    recorder = record.strategy.recorder(record, run.device, run.shrinkage == "auto")
    stop = _StopAfterGroup([record], run.calls)
    handles = [record.module.register_forward_pre_hook(recorder, with_kwargs=True)]
    handles.append(record.module.register_forward_hook(stop.hook(record)))
    log = swap_modules(model, list({**run.prefitted, **{name: fit.module for name, fit in fits.items()}}.items()))
    try:
        with evaluation_run(model):
            for index, batch in enumerate(run.batches if run.converted_batches is None else run.converted_batches):
                stop.run(model, batch, index)
                check_finite_inputs(record.name, index, recorder.statistics())
    finally:
        undo_swaps(log)
        for handle in handles:
            handle.remove()
        recorder.last_input = None
    reduce_recorders([record], {record.name: recorder})
    fitted = fit_split([record], lambda _, r: r.strategy.fit(r, recorder, "svd", run.seeds[r.name], run.fit, run.shrinkage))
    return fitted[record.name]


def _fit_group(model: nn.Module, group: List[LayerRecord], fits: Dict[str, FitResult], run: _Run) -> None:
    """Record one group's statistics, fit its layers into ``fits``, and free the statistics;
    a group whose members turn out not to share their inputs is fitted layer by layer."""
    if not group[0].kind.sequential_regression:  # such kinds read their own rows: never grouped
        fits[group[0].name] = _fit_on_current_inputs(model, group[0], fits, run)
        return
    stats = _GroupStatistics(group, run.device, run.shrinkage == "auto")
    fitted = {**run.prefitted, **{name: fit.module for name, fit in fits.items()}}
    _record_group(model, stats, run.batches, fitted, run.calls, run.converted_batches)
    stats.shared = agree_any([stats.shared], "sequential groups")[0]
    if not stats.shared and len(group) > 1:
        del stats
        for record in group:
            _fit_group(model, [record], fits, run)
        return
    reduce_group_statistics(stats)  # across processes: every rank's sums added in rank order
    fits.update(fit_split(group, lambda _, record: _fit_member(record, stats, run.seeds[record.name], run.fit,
                                                               run.shrinkage)))  # across processes: one rank each


def fit_sequentially(
    model: nn.Module,
    records: List[LayerRecord],
    batches,
    *,
    seed: Optional[int] = None,
    device: Optional[torch.device] = None,
    progress: Optional[bool] = None,
    fit: str = "auto",
    converted_batches=None,
    prefitted: Optional[Dict[str, nn.Module]] = None,
    shrinkage="auto",
) -> Tuple[Dict[str, FitResult], List[LayerRecord]]:
    """Fit ``records`` (sizes planned) group by group in model order; ``model`` is not
    changed (fitted layers are swapped in only while the next group records).

    Returns ``(fits by name, records the batches never reached)``; a layer's sketches use
    ``seed + its index in records``. Statistics live on ``device`` (None: the layer's);
    ``fit`` picks the decomposition as in :func:`~panther_lite.conversion.fitting.layer.fit_layer`.
    ``converted_batches`` (default: ``batches``) are what the partly converted model runs on,
    paired with ``batches`` one to one: the inputs it receives where they differ from the
    original model's (a block whose earlier blocks are already converted). ``prefitted``:
    ``{name: module}`` fitted before (other layers), swapped in with the fits for those runs.
    ``shrinkage``: the config's option (``"auto"`` or a strength; 0 is off).
    """
    if callable(batches):
        batches = [batches]  # one "batch": a call of fn(model)
    for first in batches:  # a None first batch is an error of group_layers, not "no batches"
        break
    else:
        return {}, list(records)
    order: CallOrder = group_layers(model, records, first)
    seeds = {record.name: layer_seed(seed, i) for i, record in enumerate(records)}
    run = _Run(batches, converted_batches, order.calls, seeds, device, fit, prefitted or {}, shrinkage)
    fits: Dict[str, FitResult] = {}
    for group in progress_bar(order.groups, "fitting sequentially", "group", progress):
        _fit_group(model, group, fits, run)
    return fits, order.unreached
