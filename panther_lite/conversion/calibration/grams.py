"""Calibration statistics: run batches through the model and record each target layer's input
Gram ``XᵀX`` (float64, or float32 beyond 2048 inputs: :func:`~panther_lite.nn.low_rank_fit.gram_dtype`), the statistic the activation-aware fit whitens by, from the rows the
layer's kind reads (:meth:`~panther_lite.conversion.kinds.LayerKind.input_rows`).

Layers whose inputs are the very same tensor (q/k/v projections of one hidden state) share
one Gram: with re-iterable calibration data (a list, a DataLoader) one batch first finds these
groups (:func:`group_layers`), then only each group's first layer accumulates while the others
check that they receive the same tensor (a group that ever does not is recorded again layer by
layer). A Gram is released as soon as the last layer using it is fitted
(:meth:`Calibration.release`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from ...nn.low_rank_fit import gram_dtype
from ...nn.validation import all_finite, check_finite
from ..process_groups.statistics import agree_any, reduce_recorders
from ..records import LayerRecord
from ..progress import progress_bar
from .batches import CalibrationData, ModelRun, evaluation_run, layer_input, run_batch, run_batch_or_callable
from .shrinkage import HeldBack, RowMoments, any_checked, layer_strength, shrink
from .tokens import layer_rows


class GramRecorder:
    """Forward pre-hook (``with_kwargs=True``) accumulating ``XᵀX`` (in ``gram_dtype(fan_in)``) of one layer's
    inputs in a ``(fan_in, fan_in)`` matrix on ``device`` (None: the layer's device), from its
    real tokens' rows (:mod:`.tokens`); with ``held_back``, also the statistics of every other
    cluster of rows that ``shrinkage="auto"`` checks its strength on (:class:`.shrinkage.HeldBack`)."""

    def __init__(self, record: LayerRecord, device: Optional[torch.device] = None, held_back: bool = False) -> None:
        self.record = record
        device = record.device if device is None else device
        self.gram = torch.zeros(record.fan_in, record.fan_in, dtype=gram_dtype(record.fan_in), device=device)
        self.moments = RowMoments()  # beside the Gram, for its shrinkage
        self.held = HeldBack.empty(record.fan_in, device) if held_back else None
        self.unaligned = False  # a token mask was active that the layer's inputs did not line up with
        self.last_input: Optional[Tensor] = None  # what the group's other layers must receive

    @property
    def rows(self) -> int:
        """The real rows recorded (padding not counted)."""
        return self.moments.rows

    def _add(self, rows: Tensor, rows_per_cluster: int, real: Optional[Tensor]) -> None:
        rows = rows.detach().to(torch.float64)
        summed = rows.to(self.gram.dtype)
        if rows.device == self.gram.device:
            self.gram.addmm_(summed.t(), summed)
        else:  # the product runs where the activations are; only its result is moved
            self.gram.add_((summed.t() @ summed).to(self.gram.device))
        self.moments.add(rows, rows_per_cluster, real)
        if self.held is not None:
            self.held.add(rows, rows_per_cluster, real)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = self.record.kind.read_input(self.record.name, module, args, kwargs)
        self.last_input = x
        found = layer_rows(self.record.kind, module, x)
        self.unaligned = self.unaligned or found.unaligned
        for (rows, rows_per_cluster), real in zip(found.chunks, found.real):
            self._add(rows, rows_per_cluster, real)

    def statistics(self) -> List[Tensor]:
        """The accumulated statistics, checked finite after each calibration batch."""
        return [self.gram]

    def finite_gram(self) -> Optional[Tensor]:
        """The Gram, or None when no batch reached the layer; ValueError naming the layer
        when the inputs held inf/NaN."""
        if self.rows == 0:
            return None
        check_finite("the Gram XᵀX of its calibration inputs", self.gram, layer=self.record.name)
        return self.gram

    def strength(self, setting, record: LayerRecord, rank: int) -> float:
        """The shrinkage strength of ``record``'s rank-``rank`` fit (``setting``: the config's
        ``shrinkage``, :func:`.shrinkage.layer_strength`); call only when :meth:`finite_gram` is not None."""
        weight = record.weight_matrix()
        return layer_strength(setting, weight, rank, self.gram, self.moments, self.held)


def spectrum_gram(recorder: Optional[GramRecorder], record: LayerRecord, config) -> Optional[Tensor]:
    """The Gram a global plan reads ``record``'s whitened spectrum from, before its rank is
    known: shrunk (``config.shrinkage``) by the strength of a fit at the rank the uniform
    ``config.param_ratio`` would give it (``ratio·fan_in·fan_out / (fan_in + fan_out)``); None
    without a recorder or when no batch reached the layer."""
    gram = None if recorder is None else recorder.finite_gram()
    if gram is None:
        return None
    ratio = config.sizes.default
    rank = max(1, int(ratio * record.fan_in * record.fan_out / (record.fan_in + record.fan_out)))
    strength = recorder.strength(config.shrinkage, record, rank)
    return shrink(gram, strength) if strength else gram


class _SameInput:
    """Forward pre-hook of a group member: notes when its input is not the very tensor the
    group's first layer (which records the Gram) has just received."""

    def __init__(self, leader: GramRecorder) -> None:
        self.leader, self.same = leader, True

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.same = self.same and layer_input(args, kwargs) is self.leader.last_input


def check_finite_inputs(name: str, batch_index: int, statistics: Iterable[Tensor]) -> None:
    """ValueError naming the batch and the layer once a layer's input statistics (Grams
    accumulated up to batch ``batch_index``) hold NaN/Inf: that batch fed it non-finite inputs."""
    if not all(all_finite(statistic) for statistic in statistics):
        raise ValueError(
            f"calibration batch {batch_index} gives layer {name!r} inputs with NaN/Inf entries (in the batch itself "
            "or produced by the layers before it); fix or drop that batch"
        )


@dataclass
class CallOrder:
    """How one batch runs through the layers: ``groups`` of records in the order of their
    first call (a group: layers fed the very same tensor), the records never ``unreached``,
    and ``calls[name]``, how often each layer was called."""

    groups: List[List[LayerRecord]]
    unreached: List[LayerRecord]
    calls: Dict[str, int]


def group_layers(model: nn.Module, records: List[LayerRecord], batch) -> CallOrder:
    """Run ``batch`` (or a callable ``fn(model)``) once and group the records: a record first
    called with the very tensor the previous call received joins that call's group when both
    kinds read the same rows from it (the same ``row_group``: linear layers; convolutions
    unfold their inputs each their own way, so stay alone). Only the latest input is held."""
    groups: List[List[LayerRecord]] = []
    calls: Dict[str, int] = {}
    previous: List[object] = [None]

    def hook_for(record):
        def pre_hook(module, args, kwargs):
            x = record.kind.read_input(record.name, module, args, kwargs)
            calls[record.name] = calls.get(record.name, 0) + 1
            if calls[record.name] == 1:
                rows = record.kind.row_group
                if rows is not None and bool(groups) and groups[-1][0].kind.row_group == rows and x is previous[0]:
                    groups[-1].append(record)
                else:
                    groups.append([record])
            previous[0] = x

        return pre_hook

    handles = [r.module.register_forward_pre_hook(hook_for(r), with_kwargs=True) for r in records]
    try:
        with evaluation_run(model):
            run_batch_or_callable(model, batch, 0)
    finally:
        for handle in handles:
            handle.remove()
    return CallOrder(groups, [record for record in records if record.name not in calls], calls)


@dataclass
class Calibration:
    """What a calibration run recorded: a Gram recorder per layer name (layers sharing an
    input share one), and ``replay``, a callable running the model once on the first batch
    (or the user's callable)."""

    recorders: Dict[str, GramRecorder]  # or a kind's own recorder (LayerKind.recorder)
    replay: Optional[ModelRun]

    def release(self, name: str) -> None:
        """Forget ``name``'s Gram; its memory is freed once no other layer shares it."""
        self.recorders.pop(name, None)


def _recording_first(batches: Iterable, first: List) -> Iterator:
    for batch in batches:
        if not first:
            first.append(batch)
        yield batch


def _record(
    model: nn.Module, groups: List[List[LayerRecord]], calibration_data, progress, device, first: List, held_back: bool
):
    """One calibration run: ``({name: recorder}, groups whose members did not share inputs)``."""
    recorders: Dict[str, GramRecorder] = {}
    checks: List[Tuple[List[LayerRecord], List[_SameInput]]] = []
    handles = []
    try:
        for group in groups:
            leader = group[0].strategy.recorder(group[0], device, held_back and any_checked(group))
            handles.append(group[0].module.register_forward_pre_hook(leader, with_kwargs=True))
            members = [_SameInput(leader) for _ in group[1:]]
            handles += [r.module.register_forward_pre_hook(m, with_kwargs=True) for r, m in zip(group[1:], members)]
            recorders.update({record.name: leader for record in group})
            checks.append((group, members))
        with evaluation_run(model):
            if callable(calibration_data):
                calibration_data(model)
            else:
                batches = progress_bar(calibration_data, "calibrating", "batch", progress)
                leaders = list({id(recorder): recorder for recorder in recorders.values()}.values())
                for index, batch in enumerate(_recording_first(batches, first)):
                    run_batch(model, batch, index)
                    for leader in leaders:  # in call order: the first layer the bad inputs reached
                        check_finite_inputs(leader.record.name, index, leader.statistics())
    finally:
        for handle in handles:
            handle.remove()
        for recorder in recorders.values():
            recorder.last_input = None
    broken = [group for group, members in checks if not all(member.same for member in members)]
    return recorders, broken


def collect_grams(
    model: nn.Module,
    records: List[LayerRecord],
    data: CalibrationData,
    progress: Optional[bool],
    device: Optional[torch.device] = None,
    held_back: bool = False,
) -> Calibration:
    """Run the calibration ``data`` through ``model`` in eval mode and no_grad, recording each
    layer's input Gram on ``device`` (None: the layer's own), one per group of layers with
    identical inputs when the data can be run again, from the batches' real tokens; with
    ``held_back`` (``shrinkage="auto"``) also each Gram's held-back half. Hooks and every
    module's training flag are restored afterwards."""
    groups = [[record] for record in records]
    calibration_data = data.source
    if data.reiterable:
        first_batch = data.first_batch()
        if first_batch is not None:
            order = group_layers(model, records, first_batch)
            groups = order.groups + [[record] for record in order.unreached]
    first: List = []
    recorders, broken = _record(model, groups, calibration_data, progress, device, first, held_back)
    flags = agree_any([any(group is b for b in broken) for group in groups], "groups sharing an input")
    broken = [group for group, flag in zip(groups, flags) if flag]  # across processes: broken on any rank
    if broken:  # rare: inputs identical on the first batch only; record those layers alone
        alone = [[record] for group in broken for record in group]
        recorders.update(_record(model, alone, calibration_data, False, device, [], held_back)[0])
    reduce_recorders(records, recorders)  # across processes: every rank's sums added in rank order
    if callable(calibration_data):
        return Calibration(recorders, calibration_data)
    return Calibration(recorders, (lambda m: run_batch(m, first[0])) if first else None)
