"""Sweeps: a dense layer and its sketched replacements over a ``num_terms × low_rank``
grid, each configuration timed interleaved with its own dense baseline, into a DataFrame
and a CSV written row by row."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import pandas as pd
import torch
import torch.nn as nn
from torch import Tensor

from ..nn import dense_size
from .accuracy import relative_output_error, structured_weight
from .cases import LayerCase
from .environment import DeviceLike, as_device, check_int, check_non_negative, device_name, ignore_size_warnings
from .memory import training_memory_bytes
from .records import CsvRows
from .roofline import DevicePeaks, measure_device_peaks, roofline_ms
from .tasks import digits_task_accuracy
from .timing import Spread, forward_backward_step, forward_step, paired_ratio, time_interleaved

COMPARED_INITS = ("sketch", "svd")  # every init of the layers: their errors are compared per configuration
ERROR_COLUMNS = tuple(f"error_{init}" for init in COMPARED_INITS)

SWEEP_COLUMNS = (
    "layer", "method", "device", "device_name", "dtype",
    "in_features", "out_features", "batch_size", "kernel_size", "image_size",
    "num_terms", "low_rank", "rank", "trainable_params", "stored_params",
    "repeats", "forward_ms", "forward_iqr_ms", "forward_backward_ms", "forward_backward_iqr_ms",
    "dense_forward_ms", "dense_forward_backward_ms", "peak_memory_bytes",
    *ERROR_COLUMNS,
    "speedup", "speedup_iqr", "speedup_forward_backward", "speedup_forward_backward_iqr", "memory_ratio",
    "anchor_forward_ms", "anchor_speedup", "anchor_speedup_iqr",
    "flops", "roofline_ms", "roofline_fraction", "task_accuracy",
)  # fmt: skip
"""Columns of a sweep's CSV and DataFrame (one row per configuration plus a dense row).

``rank`` is ``2Lk``; ``trainable_params``/``stored_params`` count parameters without/with
the fixed sketch buffers; ``repeats`` is the number of timed calls behind every time of
the row. ``forward_ms``/``forward_backward_ms`` are medians, ``*_iqr_ms`` their
interquartile ranges. Each configuration is timed in alternation with the dense layer
(and the anchor's formulation): ``dense_forward_ms``/``dense_forward_backward_ms`` are
the dense medians of those same rounds, and ``speedup`` (dense / sketched forward time),
``speedup_forward_backward`` and ``anchor_speedup`` (anchor / sketched forward time) are
medians of the per-round ratios, with their IQRs in ``*_iqr``. ``peak_memory_bytes`` is
:func:`training_memory_bytes` and ``memory_ratio`` = sketched / dense memory;
``error_<init>`` is the relative output error of that init against the dense layer;
``roofline_fraction`` = roofline time / forward time (CUDA only, else empty);
``task_accuracy`` only with ``task_accuracy=True``."""


def _check_sweep(case, num_terms, low_rank, dtype, warmup, repeats, seed, decay, task_width, task_epochs) -> None:
    """Every argument of :func:`run_sweep` checked before anything is measured or written."""
    if not isinstance(case, LayerCase):
        raise TypeError(f"case must be a LinearCase or Conv2dCase, got {type(case).__name__}")
    if not num_terms or not low_rank:
        raise ValueError("num_terms and low_rank must each hold at least one value")
    for value in num_terms:
        check_int("every num_terms", value, 1)
    for value in low_rank:
        check_int("every low_rank", value, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)
    check_int("seed", seed, 0)
    check_non_negative("decay", decay)
    check_int("task_width", task_width, 1)
    check_int("task_epochs", task_epochs, 1)


def _spread_columns(prefix: str, spread: Spread) -> Dict[str, float]:
    return {f"{prefix}_ms": spread.median, f"{prefix}_iqr_ms": spread.iqr}


def _dense_timings(dense: nn.Module, x: Tensor, device, warmup: int, repeats: int) -> Dict[str, float]:
    """The dense layer's own row: forward and forward+backward medians and IQRs."""
    forward = time_interleaved({"dense": forward_step(dense, x)}, device=device, warmup=warmup, repeats=repeats)
    both = time_interleaved({"dense": forward_backward_step(dense, x)}, device=device, warmup=warmup, repeats=repeats)
    return dict(
        **_spread_columns("forward", Spread.of(forward["dense"])),
        **_spread_columns("forward_backward", Spread.of(both["dense"])),
        speedup=1.0, speedup_forward_backward=1.0,
    )  # fmt: skip


def _interleaved_timings(dense: nn.Module, sketched: nn.Module, anchor: Callable, x: Tensor, device, warmup, repeats):
    """A configuration timed in alternation with its dense baseline (and, forward only,
    the anchor's formulation): medians, IQRs and per-round ratios."""
    forward = time_interleaved(
        {"dense": forward_step(dense, x), "sketched": forward_step(sketched, x), "anchor": forward_step(anchor, x)},
        device=device, warmup=warmup, repeats=repeats,
    )  # fmt: skip
    both = time_interleaved(
        {"dense": forward_backward_step(dense, x), "sketched": forward_backward_step(sketched, x)},
        device=device, warmup=warmup, repeats=repeats,
    )  # fmt: skip
    speedup = paired_ratio(forward["dense"], forward["sketched"])
    speedup_both = paired_ratio(both["dense"], both["sketched"])
    anchor_speedup = paired_ratio(forward["anchor"], forward["sketched"])
    return dict(
        **_spread_columns("forward", Spread.of(forward["sketched"])),
        **_spread_columns("forward_backward", Spread.of(both["sketched"])),
        dense_forward_ms=Spread.of(forward["dense"]).median,
        dense_forward_backward_ms=Spread.of(both["dense"]).median,
        speedup=speedup.median, speedup_iqr=speedup.iqr,
        speedup_forward_backward=speedup_both.median, speedup_forward_backward_iqr=speedup_both.iqr,
        anchor_forward_ms=Spread.of(forward["anchor"]).median,
        anchor_speedup=anchor_speedup.median, anchor_speedup_iqr=anchor_speedup.iqr,
    )  # fmt: skip


def run_sweep(
    case: LayerCase,
    num_terms: Sequence[int],
    low_rank: Sequence[int],
    *,
    device: DeviceLike = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 3,
    repeats: int = 10,
    seed: int = 0,
    decay: float = 1.0,
    csv_path: Optional[Union[str, Path]] = None,
    progress: bool = True,
    task_accuracy: bool = False,
    task_width: int = 128,
    task_epochs: int = 20,
    peaks: Optional[DevicePeaks] = None,
    on_row: Optional[Callable[[Dict[str, object]], None]] = None,
) -> pd.DataFrame:
    """Measure the dense layer of ``case`` and its sketched replacement at every
    ``(num_terms, low_rank)`` of the grid; returns a DataFrame with :data:`SWEEP_COLUMNS`.

    The dense layer's weight is :func:`structured_weight` (singular values ``∝ i^-decay``);
    for each configuration the sketched layer is built from it with every init
    (``"sketch"`` and ``"svd"``) for the ``error_<init>`` columns, and the ``"svd"`` one is
    timed (speed does not depend on the init) in alternation with the dense layer and the
    anchor's formulation (:func:`time_interleaved`), so a burst of other work on the
    machine slows both sides of each ratio alike.

    Args:
        case: a :class:`LinearCase` or :class:`Conv2dCase`.
        num_terms, low_rank: the grid (``L`` values × ``k`` values).
        device, dtype: where and at which dtype every layer runs.
        warmup, repeats: untimed and timed rounds of :func:`time_interleaved`.
        seed: seeds the weight, bias, input and sketches.
        csv_path: if given, each row is appended to ``<csv_path>.partial`` and flushed as
            soon as it is measured, and that file replaces ``csv_path`` when the sweep ends
            or is interrupted (:class:`CsvRows`): a previous CSV is never half-overwritten.
        progress: show a tqdm bar on stderr.
        task_accuracy: also train :func:`digits_task_accuracy` per configuration
            (``task_width``, ``task_epochs``).
        peaks: the device's :class:`DevicePeaks` for the roofline columns; measured once
            here on CUDA (at ``dtype``) when None. Without peaks (CPU) the roofline columns are empty.
        on_row: called with each row (a dict) after it is written.

    Every argument is checked before anything is measured or written.
    """
    num_terms, low_rank = list(num_terms), list(low_rank)
    _check_sweep(case, num_terms, low_rank, dtype, warmup, repeats, seed, decay, task_width, task_epochs)
    device = as_device(device)
    if peaks is None and device.type == "cuda":
        peaks = measure_device_peaks(device, dtype)
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    shape = case.gemm
    weight = structured_weight(shape.fan_out, shape.fan_in, decay=decay, seed=seed, dtype=dtype, device=device)
    dense = case.dense_module(weight, generator)
    x = case.make_input(generator, dtype, device)
    element_size = weight.element_size()
    base = dict(
        layer=case.layer, device=str(device), device_name=device_name(device), dtype=str(dtype).removeprefix("torch."),
        repeats=repeats, **case.describe(),
    )  # fmt: skip
    task = dict(width=task_width, epochs=task_epochs, seed=seed, device=device) if task_accuracy else None
    rows: List[Dict[str, object]] = []
    bar = tqdm(total=1 + len(num_terms) * len(low_rank), file=sys.stderr, disable=not progress, desc=f"{case.layer} sweep")
    with CsvRows(csv_path, SWEEP_COLUMNS) as writer:
        try:
            rows.append(dict(base, **_dense_row(case, dense, x, device, warmup, repeats, element_size, task)))
            _finish(rows[-1], peaks, writer, bar, on_row)
            for L, k in itertools.product(num_terms, low_rank):
                bar.set_postfix(num_terms=L, low_rank=k)
                row = _sketched_row(case, dense, x, L, k, seed, device, warmup, repeats, element_size, task)
                row["memory_ratio"] = row["peak_memory_bytes"] / rows[0]["peak_memory_bytes"]
                rows.append(dict(base, **row))
                _finish(rows[-1], peaks, writer, bar, on_row)
        finally:
            bar.close()
    return pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def _finish(row: Dict[str, object], peaks, writer: CsvRows, bar, on_row) -> None:
    """Fill the roofline columns, write the row, advance the bar, call ``on_row``."""
    bytes_moved = row.pop("bytes")
    if peaks is not None:
        row["roofline_ms"] = roofline_ms(row["flops"], bytes_moved, peaks)
        row["roofline_fraction"] = row["roofline_ms"] / row["forward_ms"]
    writer.write(row)
    bar.update()
    if on_row is not None:
        on_row(row)


def _dense_row(case, dense, x, device, warmup, repeats, element_size, task) -> Dict[str, object]:
    shape = case.gemm
    size = dense_size(shape.fan_in, shape.fan_out)
    row = dict(
        method="dense", rank=min(shape.fan_in, shape.fan_out), trainable_params=size, stored_params=size,
        **_dense_timings(dense, x, device, warmup, repeats), peak_memory_bytes=training_memory_bytes(dense, x.detach().requires_grad_(True)),
        **{c: 0.0 for c in ERROR_COLUMNS}, memory_ratio=1.0, flops=case.dense_flops(),
        bytes=case.dense_bytes(element_size),
    )  # fmt: skip
    if task is not None:
        row["task_accuracy"] = digits_task_accuracy(case.layer, **task)
    return row


def _sketched_row(case, dense, x, L, k, seed, device, warmup, repeats, element_size, task) -> Dict[str, object]:
    with ignore_size_warnings():
        layers = {init: case.sketched_module(dense, L, k, init, seed) for init in COMPARED_INITS}
    timed = layers["svd"]
    counts = timed.parameter_counts()
    row = dict(
        method="sketched", num_terms=L, low_rank=k, rank=2 * L * k,
        trainable_params=counts.trainable, stored_params=counts.stored,
        **_interleaved_timings(dense, timed, case.anchor(timed), x, device, warmup, repeats),
        peak_memory_bytes=training_memory_bytes(timed, x.detach().requires_grad_(True)),
        **{f"error_{init}": relative_output_error(layer, dense, x) for init, layer in layers.items()},
        flops=case.sketch_flops(L, k), bytes=case.sketch_bytes(L, k, element_size),
    )  # fmt: skip
    if task is not None:
        row["task_accuracy"] = digits_task_accuracy(case.layer, L, k, **task)
    return row
