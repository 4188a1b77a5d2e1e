"""Calibration: run batches through the model and record each target layer's input Gram
``XᵀX`` (float64), the statistic the activation-aware fit whitens by.

Layers whose inputs are the very same tensor (q/k/v projections of one hidden state) share
one Gram: with re-iterable calibration data (a list, a DataLoader) one batch first finds these
groups (:func:`group_layers`), then only each group's first layer accumulates while the others
check that they receive the same tensor (a group that ever does not is recorded again layer by
layer). A Gram is released as soon as the last layer using it is fitted
(:meth:`Calibration.release`).

A convolution's rows are its unfolded input patches, ordered ``C_in·k1·k2·…`` like the
kernel's unfolding ``weight.reshape(C_out, -1)``, in 1-D, 2-D and 3-D alike.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..nn.validation import check_finite
from .kinds import LINEAR_KINDS
from .layer_record import LayerRecord
from .progress import progress_bar
from .shrinkage import RowMoments, cluster_size, shrink, shrinkage_intensity

# Per-chunk bound on the unfolded patches of a convolution's input (entries), so the
# Gram of a large feature map is accumulated in slices of the batch.
_MAX_PATCH_ENTRIES = 1 << 24

ModelRun = Callable[[nn.Module], object]


def check_calibration_data(calibration_data) -> None:
    """TypeError unless ``calibration_data`` is None, a callable or an iterable of batches."""
    if calibration_data is None or callable(calibration_data):
        return
    if isinstance(calibration_data, Tensor):
        raise TypeError(
            "calibration_data must be an iterable of batches or a callable fn(model), got a single Tensor; "
            "pass e.g. [x] or x.split(256)"
        )
    if isinstance(calibration_data, (str, bytes)) or not isinstance(calibration_data, Iterable):
        raise TypeError(f"calibration_data must be an iterable of batches or a callable fn(model), got {calibration_data!r}")


def check_calibration_device(device: Union[str, torch.device, None]) -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (None stays None); it must hold real values."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"calibration_device must be None, a str or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"calibration_device {device!r} is not a valid device: {error}") from None
    if device.type == "meta":
        raise ValueError(
            "calibration_device='meta' holds no values, so no Gram could be accumulated; "
            "pass None (each layer's own device) or a real device such as 'cpu'"
        )
    return device


def run_batch(model: nn.Module, batch, index: Optional[int] = None) -> object:
    """``model(b)`` for a Tensor, ``model(*b)`` for a tuple/list, ``model(**b)`` for a dict;
    ``index`` (the batch's position, when known) goes into the error for any other batch."""
    if batch is None:
        where = "" if index is None else f" {index}"
        raise TypeError(
            f"calibration batch{where} is None; calibration_data must hold only batches (Tensor, tuple or dict)"
        )
    if isinstance(batch, Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    raise TypeError(
        f"calibration batches must be a Tensor (model(b)), a tuple/list (model(*b)) or a dict (model(**b)), "
        f"got {type(batch).__name__}"
    )


def run_batch_or_callable(model: nn.Module, batch_or_fn, index: Optional[int] = None) -> object:
    """``fn(model)`` for a callable calibration ``fn``, else :func:`run_batch`."""
    return batch_or_fn(model) if callable(batch_or_fn) else run_batch(model, batch_or_fn, index)


@contextlib.contextmanager
def evaluation_run(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode under ``torch.no_grad()``; every module's training flag is
    restored afterwards, also on error."""
    training = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, flag in training.items():
            module.training = flag


def layer_input(args: tuple, kwargs: dict) -> Tensor:
    """The input of a call to a stock linear/convolution forward (the only forwards convert
    accepts): the positional argument or the ``input=`` keyword."""
    return args[0] if args else kwargs["input"]


def conv_patches(conv: nn.Module, x: Tensor) -> Tensor:
    """Unfolded input patches ``(N·positions, C_in·k1·k2·…)`` of an N-d convolution (the
    order of ``conv.weight.reshape(C_out, -1)``), padded as the convolution pads."""
    spatial = len(conv.kernel_size)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    for dim, (size, stride, dilation) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation)):
        x = x.unfold(2 + dim, dilation * (size - 1) + 1, stride)[..., ::dilation]
    # x: (N, C_in, out_1..out_n, k_1..k_n) -> rows (N, out_1..out_n) of columns (C_in, k_1..k_n)
    order = (0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    return x.permute(order).reshape(-1, conv.weight[0].numel())


def checked_input(record: LayerRecord, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The layer's input; ValueError naming the layer when its feature (linear) or channel
    (convolution) dimension does not fit the layer, or its dtype is not the weight's (outside
    autocast, where the layer itself would fail)."""
    x = layer_input(args, kwargs)
    if record.kind in LINEAR_KINDS:
        dim, expected, what = -1, record.fan_in, "last dimension (features)"
    else:
        dim, expected, what = -len(module.kernel_size) - 1, module.in_channels, "channels"
    if x.dim() < -dim or x.shape[dim] != expected:
        raise ValueError(
            f"calibration: layer {record.name!r} expects inputs with {what} {expected}, got a batch "
            f"whose input to it has shape {tuple(x.shape)}; check that calibration_data matches the model"
        )
    weight_dtype = module.weight.dtype
    autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    if x.dtype != weight_dtype and not autocast:
        raise ValueError(
            f"calibration: layer {record.name!r} has {weight_dtype} weights, got a batch whose input to it is "
            f"{x.dtype}; convert the batches to the model's dtype (or run them under torch.autocast)"
        )
    return x


class GramRecorder:
    """Forward pre-hook (``with_kwargs=True``) accumulating ``XᵀX`` (float64) of one layer's
    inputs in a ``(fan_in, fan_in)`` matrix on ``device`` (None: the layer's device)."""

    def __init__(self, record: LayerRecord, device: Optional[torch.device] = None) -> None:
        self.record = record
        device = record.module.weight.device if device is None else device
        self.gram = torch.zeros(record.fan_in, record.fan_in, dtype=torch.float64, device=device)
        self.rows = 0
        self.moments = RowMoments()  # beside the Gram, for its shrinkage
        self.last_input: Optional[Tensor] = None  # what the group's other layers must receive

    def _add(self, rows: Tensor, rows_per_cluster: int = 1) -> None:
        rows = rows.detach().to(torch.float64)
        if rows.device == self.gram.device:
            self.gram.addmm_(rows.t(), rows)
        else:  # the product runs where the activations are; only its result is moved
            self.gram.add_((rows.t() @ rows).to(self.gram.device))
        self.moments.add(rows, rows_per_cluster)
        self.rows += rows.shape[0]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = checked_input(self.record, module, args, kwargs)
        self.last_input = x
        if self.record.kind in LINEAR_KINDS:
            self._add(x.reshape(-1, x.shape[-1]), cluster_size(x))
            return
        spatial = len(module.kernel_size)
        if x.dim() == spatial + 1:  # unbatched
            x = x.unsqueeze(0)
        step = max(1, _MAX_PATCH_ENTRIES // max(1, x[:1].numel() * math.prod(module.kernel_size)))
        for chunk in x.split(step):
            self._add(conv_patches(module, chunk))

    def finite_gram(self) -> Optional[Tensor]:
        """The Gram, or None when no batch reached the layer; ValueError naming the layer
        when the inputs held inf/NaN."""
        if self.rows == 0:
            return None
        check_finite("the Gram XᵀX of its calibration inputs", self.gram, layer=self.record.name)
        return self.gram

    def fit_gram(self) -> Optional[Tensor]:
        """The Gram the fit whitens by: :meth:`finite_gram` shrunk towards its diagonal as
        far as its rows warrant (:mod:`.shrinkage`); None when no batch reached the layer."""
        gram = self.finite_gram()
        return None if gram is None else shrink(gram, shrinkage_intensity(gram, self.moments))


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
    if not all(bool(torch.isfinite(statistic).all()) for statistic in statistics):
        raise ValueError(
            f"calibration batch {batch_index} gives layer {name!r} inputs with NaN/Inf entries (in the batch itself "
            "or produced by the layers before it); fix or drop that batch"
        )


def reiterable(calibration_data) -> bool:
    """Whether the batches can be run again (not a callable, not a one-shot iterator)."""
    return not callable(calibration_data) and iter(calibration_data) is not calibration_data


@dataclass
class CallOrder:
    """How one batch runs through the layers: ``groups`` of records in the order of their
    first call (a group: layers fed the very same tensor), the records never ``unreached``,
    and ``calls[name]``, how often each layer was called."""

    groups: List[List[LayerRecord]]
    unreached: List[LayerRecord]
    calls: Dict[str, int]


def group_layers(model: nn.Module, records: List[LayerRecord], batch) -> CallOrder:
    """Run ``batch`` (or a callable ``fn(model)``) once and group the records: a linear record first called with the very
    tensor the previous call received joins that call's group (convolutions unfold their
    inputs each their own way, so stay alone). Only the latest input is held."""
    groups: List[List[LayerRecord]] = []
    calls: Dict[str, int] = {}
    previous: List[object] = [None]

    def hook_for(record):
        def pre_hook(module, args, kwargs):
            x = checked_input(record, module, args, kwargs)
            calls[record.name] = calls.get(record.name, 0) + 1
            if calls[record.name] == 1:
                linear = record.kind in LINEAR_KINDS and bool(groups) and groups[-1][0].kind in LINEAR_KINDS
                if linear and x is previous[0]:
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

    recorders: Dict[str, GramRecorder]
    replay: Optional[ModelRun]

    def release(self, name: str) -> None:
        """Forget ``name``'s Gram; its memory is freed once no other layer shares it."""
        self.recorders.pop(name, None)


def _recording_first(batches: Iterable, first: List) -> Iterator:
    for batch in batches:
        if not first:
            first.append(batch)
        yield batch


def _record(model: nn.Module, groups: List[List[LayerRecord]], calibration_data, progress, device, first: List):
    """One calibration run: ``({name: recorder}, groups whose members did not share inputs)``."""
    recorders: Dict[str, GramRecorder] = {}
    checks: List[Tuple[List[LayerRecord], List[_SameInput]]] = []
    handles = []
    try:
        for group in groups:
            leader = GramRecorder(group[0], device)
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
                        check_finite_inputs(leader.record.name, index, [leader.gram])
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
    calibration_data,
    progress: Optional[bool],
    device: Optional[torch.device] = None,
) -> Calibration:
    """Run the calibration data through ``model`` in eval mode and no_grad, recording each
    layer's input Gram on ``device`` (None: the layer's own), one per group of layers with
    identical inputs when the data can be run again; hooks and every module's training flag
    are restored afterwards."""
    groups = [[record] for record in records]
    if reiterable(calibration_data):
        first_batch = next(iter(calibration_data), None)
        if first_batch is not None:
            order = group_layers(model, records, first_batch)
            groups = order.groups + [[record] for record in order.unreached]
    first: List = []
    recorders, broken = _record(model, groups, calibration_data, progress, device, first)
    if broken:  # rare: inputs identical on the first batch only; record those layers alone
        alone = [[record] for group in broken for record in group]
        recorders.update(_record(model, alone, calibration_data, False, device, [])[0])
    if callable(calibration_data):
        return Calibration(recorders, calibration_data)
    return Calibration(recorders, (lambda m: run_batch(m, first[0])) if first else None)
