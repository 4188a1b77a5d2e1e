"""Plots of measurements, drawn on pyplot-free matplotlib figures (matplotlib is imported
only when a plot is made): the sweep's heatmaps and error-versus-time trade-off, and the
figure helpers scripts draw their own plots with; a sweep's CSV and plots published as one unit."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import List, Tuple, Union

import numpy as np
import pandas as pd

from ..extras import require
from .analysis import pareto_front
from .sweep import COMPARED_INITS

_HEATMAPS = (
    ("speedup", "forward speed-up over dense (×)", "RdYlGn"),
    ("speedup_forward_backward", "fwd+bwd speed-up over dense (×)", "RdYlGn"),
    ("memory_ratio", "memory / dense memory", "RdYlGn_r"),
    *((f"error_{init}", f"relative output error, init='{init}'", "viridis_r") for init in COMPARED_INITS),
    ("anchor_speedup", "speed-up over the anchor formulation (×)", "RdYlGn"),
    ("roofline_fraction", "fraction of roofline", "RdYlGn"),
    ("task_accuracy", "digits test accuracy", "viridis"),
)


def new_figure(**kwargs):
    """A matplotlib ``Figure`` (keyword arguments as ``Figure``'s) that is never registered
    with pyplot, so plotting neither needs a display nor changes the caller's backend;
    draw on it with the object-oriented API (``fig.subplots()``) and save it with
    :func:`save_figure`."""
    Figure = require("matplotlib.figure", "plotting").Figure

    return Figure(**kwargs)


def save_figure(fig, path: Union[str, Path], *, dpi: int = 110) -> Path:
    """Lay out ``fig`` and save it as a PNG at ``path`` (creating its folder); returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def _sketched(df: pd.DataFrame) -> pd.DataFrame:
    sketched = df[df["method"] == "sketched"]
    if sketched.empty:
        raise ValueError("the sweep has no sketched rows to plot")
    return sketched


def _title(df: pd.DataFrame) -> str:
    first = df.iloc[0]
    shape = f"{first['in_features']}→{first['out_features']}, batch {first['batch_size']}"
    if first["layer"] == "conv2d":
        shape += f", {first['kernel_size']}×{first['kernel_size']} kernel, {first['image_size']}² images"
    return f"{first['layer']} {shape}, {first['dtype']}, {first['device_name']}"


def plot_heatmaps(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Heatmaps over the ``num_terms × low_rank`` grid of every metric the sweep has
    (speed-ups, memory ratio, errors per init, anchor speed-up, roofline fraction, task
    accuracy); saves a PNG at ``path`` and returns it."""
    sketched = _sketched(df)
    panels = [p for p in _HEATMAPS if p[0] in sketched and sketched[p[0]].notna().any()]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = new_figure(figsize=(4.6 * ncols, 3.8 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (column, label, cmap) in zip(axes.flat, panels):
        grid = sketched.pivot_table(index="num_terms", columns="low_rank", values=column, aggfunc="mean")
        image = ax.imshow(grid.to_numpy(dtype=float), cmap=cmap, aspect="auto", origin="lower")
        ax.set_xticks(range(grid.shape[1]), [str(int(c)) for c in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [str(int(i)) for i in grid.index])
        ax.set_xlabel("low_rank k")
        ax.set_ylabel("num_terms L")
        ax.set_title(label, fontsize=10)
        for (i, j), value in np.ndenumerate(grid.to_numpy(dtype=float)):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(_title(df), fontsize=11)
    return save_figure(fig, path)


def plot_tradeoff(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Relative output error against forward time, one series per init, with each
    init's Pareto front drawn and marked and the dense layer's time as a line; saves a
    PNG at ``path`` and returns it."""
    sketched = _sketched(df)
    fig = new_figure(figsize=(7.5, 5))
    ax = fig.subplots()
    for init, colour, label_offset in zip(COMPARED_INITS, ("tab:orange", "tab:blue"), ((5, 6), (5, -12))):
        column = f"error_{init}"
        points = sketched[["forward_ms", column, "num_terms", "low_rank"]].dropna()
        if points.empty:
            continue
        ax.scatter(points["forward_ms"], points[column], color=colour, alpha=0.45, label=f"init='{init}'")
        front = points[pareto_front(points["forward_ms"], points[column])].sort_values("forward_ms")
        ax.plot(front["forward_ms"], front[column], "-o", color=colour, markerfacecolor="none", markersize=11,
                label=f"Pareto front, init='{init}'")
        labelled = []
        for _, p in front.iterrows():
            where = (math.log10(p["forward_ms"]), math.log10(max(p[column], 1e-30)))
            if any(abs(where[0] - x) < 0.12 and abs(where[1] - y) < 0.2 for x, y in labelled):
                continue  # a neighbour on the front already carries a label here
            labelled.append(where)
            ax.annotate(f"L={int(p['num_terms'])},k={int(p['low_rank'])}", (p["forward_ms"], p[column]),
                        textcoords="offset points", xytext=label_offset, fontsize=7)
    dense = df[df["method"] == "dense"]
    if not dense.empty:
        ax.axvline(float(dense["forward_ms"].iloc[0]), color="black", linestyle="--", label="dense forward time")
    ax.set_xlabel("forward time (ms)")
    ax.set_ylabel("relative output error vs dense")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a short log axis
    ax.set_title(_title(df), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return save_figure(fig, path)


def replace_sweep_plots(df: pd.DataFrame, heatmaps_path: Union[str, Path], tradeoff_path: Union[str, Path]) -> list:
    """Make the plots at ``heatmaps_path`` and ``tradeoff_path`` show ``df`` and nothing
    older: drawn over any previous run's plots, or — when ``df`` has no sketched rows to
    plot — the previous run's plots removed, so that none is left beside a CSV it does
    not show. Returns one line per file saying what was done."""
    paths = (Path(heatmaps_path), Path(tradeoff_path))
    if (df["method"] == "sketched").any():
        return [
            f"{'replaced' if path.exists() else 'wrote'} {plot(df, path)}"
            for plot, path in zip((plot_heatmaps, plot_tradeoff), paths)
        ]
    lines = []
    for path in paths:
        if path.exists():
            path.unlink()
            lines.append(f"removed {path}: a previous run's plot, and this run has no sketched rows to plot")
    return lines


def staged_path(path: Union[str, Path]) -> Path:
    """Where ``path`` is prepared before it is published: a hidden sibling, same suffix."""
    path = Path(path)
    return path.with_name(f".{path.stem}.staged{path.suffix}")


def publish_sweep_results(
    staged_csv: Union[str, Path],
    csv_path: Union[str, Path],
    heatmaps_path: Union[str, Path],
    tradeoff_path: Union[str, Path],
) -> Tuple[pd.DataFrame, List[str]]:
    """Publish a sweep measured into ``staged_csv`` (see :func:`staged_path`) as ``csv_path``
    with its plots, as one unit: the plots are drawn under staged names first, then the
    previous run's plots are removed, the CSV is renamed over ``csv_path`` and the new plots
    are renamed into place. Interrupted anywhere (a second Ctrl-C while drawing), the
    directory holds the previous CSV (with its plots or none), or the new CSV with its plots
    or none: never a plot of another run beside a CSV. A KeyboardInterrupt while drawing
    publishes the CSV without plots. Returns the rows and one line per file published."""
    csv_path, staged_csv = Path(csv_path), Path(staged_csv)
    paths = [Path(heatmaps_path), Path(tradeoff_path)]
    staged = [staged_path(path) for path in paths]
    df, lines = pd.read_csv(staged_csv), []
    try:
        try:
            if (df["method"] == "sketched").any():
                for plot, path in zip((plot_heatmaps, plot_tradeoff), staged):
                    plot(df, path)
        except KeyboardInterrupt:
            lines.append("interrupted while drawing the plots: the CSV is published without the missing ones")
        existed = [path.exists() for path in paths]
        for path in paths:
            path.unlink(missing_ok=True)
        os.replace(staged_csv, csv_path)
        lines.append(f"wrote {csv_path}")
        for draft, path, old in zip(staged, paths, existed):
            if draft.exists():
                os.replace(draft, path)
                lines.append(f"{'replaced' if old else 'wrote'} {path}")
            elif old:
                lines.append(f"removed {path}: a previous run's plot, and this run drew none to replace it")
    finally:
        for draft in staged:
            draft.unlink(missing_ok=True)
    return df, lines
