"""Measurement library of panther_lite (imported lazily by ``panther_lite``: it needs pandas,
and matplotlib when plotting). Each submodule holds one part; every public name is
re-exported here.

* :mod:`~panther_lite.benchmark.timing` — warm-up, then calls timed one by one
  (``perf_counter`` on the CPU, CUDA events on a GPU), interleaved across the callables
  compared (:func:`time_interleaved`), medians and IQRs (:class:`Spread`,
  :func:`paired_ratio`), and :func:`time_callable`.
* :mod:`~panther_lite.benchmark.memory` — parameter counts and bytes, activations saved for
  backward, the training-forward footprint.
* :mod:`~panther_lite.benchmark.accuracy` — trained-like weights
  (:func:`structured_weight`) and relative output error.
* :mod:`~panther_lite.benchmark.anchor` — the anchor's per-term formulation, a reference.
* :mod:`~panther_lite.benchmark.roofline` — measured device peaks and roofline times.
* :mod:`~panther_lite.benchmark.cases` — layer shapes as GEMMs with their dense and
  sketched modules (:class:`LinearCase`, :class:`Conv2dCase`).
* :mod:`~panther_lite.benchmark.tasks` — the digits task: :func:`load_digits_split`,
  :func:`mlp_classifier`, :func:`cnn_classifier`, :func:`train_classifier`,
  :func:`accuracy`, :func:`digits_task_accuracy`.
* :mod:`~panther_lite.benchmark.sweep` — :func:`run_sweep` over a ``num_terms × low_rank``
  grid, with :data:`SWEEP_COLUMNS`; rows go to a CSV as measured
  (:mod:`~panther_lite.benchmark.records`).
* :mod:`~panther_lite.benchmark.analysis` and :mod:`~panther_lite.benchmark.plots` —
  timings too noisy to read (:func:`relative_spread`, :func:`noisy`, :func:`noisy_rows`,
  :func:`noise_note`), :func:`pareto_front`, heatmaps (noisy cells hatched), trade-off
  plots and pyplot-free figures.
* :mod:`~panther_lite.benchmark.bars` — performance bars: a sketched callable timed in
  alternation with its reference (:func:`compare`), rows, lines and a figure.
* :mod:`~panther_lite.benchmark.layouts` — sketched layouts at a ``param_ratio`` without
  fitting (:func:`ratio_layout`), for benchmarks with random factors.
* :mod:`~panther_lite.benchmark.deploy` — a model's deployable forms (dense, converted,
  frozen, int8) in PyTorch and onnxruntime: :func:`deployable_forms`, :func:`deploy_rows`
  (size on disk, latency, quality), :func:`plot_deploy`, and the ONNX steps
  (:func:`export_onnx`, :func:`quantize_onnx_int8`, :func:`onnx_runner`).
"""
from __future__ import annotations

from .accuracy import relative_output_error, structured_weight
from .analysis import NOISE_THRESHOLD, noise_note, noisy, noisy_rows, pareto_front, relative_spread
from .anchor import anchor_conv2d, anchor_linear
from .bars import BAR_COLUMNS, bar_line, compare, plot_bars, save_bars
from .cases import Conv2dCase, GemmShape, LayerCase, LinearCase
from .deploy import (
    DEPLOY_COLUMNS,
    DEPLOY_FORMS,
    deploy_rows,
    deployable_forms,
    export_onnx,
    onnx_runner,
    plot_deploy,
    quantize_onnx_int8,
    saved_size_bytes,
)
from .environment import device_name, ignore_size_warnings
from .layouts import ratio_layout
from .memory import count_parameters, parameter_bytes, saved_activation_bytes, training_memory_bytes
from .plots import (
    new_figure, plot_heatmaps, plot_tradeoff, publish_sweep_results, replace_sweep_plots, save_figure, staged_path,
)
from .records import CsvRows, write_table_and_figure
from .roofline import DevicePeaks, measure_device_peaks, roofline_ms
from .sweep import ERROR_COLUMNS, SWEEP_COLUMNS, run_sweep
from .tasks import (
    LabelledData,
    accuracy,
    cnn_classifier,
    digits_task_accuracy,
    load_digits_split,
    mlp_classifier,
    train_classifier,
)
from .timing import Spread, forward_backward_step, forward_step, paired_ratio, time_callable, time_interleaved

__all__ = [
    "ratio_layout",
    "DEPLOY_COLUMNS",
    "DEPLOY_FORMS",
    "deploy_rows",
    "deployable_forms",
    "export_onnx",
    "onnx_runner",
    "plot_deploy",
    "quantize_onnx_int8",
    "saved_size_bytes",
    "time_callable",
    "time_interleaved",
    "compare",
    "BAR_COLUMNS",
    "bar_line",
    "plot_bars",
    "save_bars",
    "paired_ratio",
    "Spread",
    "forward_step",
    "forward_backward_step",
    "ignore_size_warnings",
    "count_parameters",
    "parameter_bytes",
    "saved_activation_bytes",
    "training_memory_bytes",
    "structured_weight",
    "relative_output_error",
    "anchor_linear",
    "anchor_conv2d",
    "DevicePeaks",
    "measure_device_peaks",
    "roofline_ms",
    "GemmShape",
    "LayerCase",
    "LinearCase",
    "Conv2dCase",
    "SWEEP_COLUMNS",
    "ERROR_COLUMNS",
    "device_name",
    "run_sweep",
    "CsvRows",
    "write_table_and_figure",
    "LabelledData",
    "load_digits_split",
    "mlp_classifier",
    "cnn_classifier",
    "train_classifier",
    "accuracy",
    "digits_task_accuracy",
    "pareto_front",
    "NOISE_THRESHOLD",
    "relative_spread",
    "noisy",
    "noisy_rows",
    "noise_note",
    "plot_heatmaps",
    "plot_tradeoff",
    "replace_sweep_plots",
    "publish_sweep_results",
    "staged_path",
    "new_figure",
    "save_figure",
]
