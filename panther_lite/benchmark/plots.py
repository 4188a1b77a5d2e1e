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

from ..figures import new_figure, save_figure
from .analysis import NOISE_THRESHOLD, SPREAD_COLUMNS, noisy, noisy_rows, pareto_front
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


def _grid(sketched: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    """``values`` (one per sketched row) on the ``num_terms × low_rank`` grid."""
    frame = sketched[["num_terms", "low_rank"]].assign(value=values.astype(float))
    return frame.pivot_table(index="num_terms", columns="low_rank", values="value", aggfunc="mean", dropna=False)


def _draw_heatmap(fig, ax, sketched: pd.DataFrame, column: str, label: str, cmap: str) -> int:
    """One panel: each cell's value, with its IQR under it where ``column`` is timed; cells
    whose IQR exceeds :data:`NOISE_THRESHOLD` × their value hatched and left out of the colour
    scale. Returns how many."""
    grid = _grid(sketched, sketched[column])
    spread = _grid(sketched, sketched[SPREAD_COLUMNS[column]]) if column in SPREAD_COLUMNS else None
    flagged = _grid(sketched, noisy(sketched, column)).fillna(0).to_numpy() > 0
    values = grid.to_numpy(dtype=float)
    steady = values[~flagged & ~np.isnan(values)]  # a noisy outlier must not set the colour scale
    limits = dict(vmin=steady.min(), vmax=steady.max()) if steady.size else {}
    image = ax.imshow(values, cmap=cmap, aspect="auto", origin="lower", **limits)
    ax.set_xticks(range(grid.shape[1]), [str(int(c)) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(int(i)) for i in grid.index])
    ax.set_xlabel("low_rank k")
    ax.set_ylabel("num_terms L")
    for (i, j), value in np.ndenumerate(values):
        if math.isnan(value):
            continue
        iqr = math.nan if spread is None else spread.iat[i, j]
        text = f"{value:.3g}" if math.isnan(iqr) else f"{value:.3g}\nIQR {iqr:.2g}"
        ax.text(j, i, text, ha="center", va="center", fontsize=8 if math.isnan(iqr) else 7,
                color="0.35" if flagged[i, j] else "black")  # fmt: skip
        if flagged[i, j]:
            from matplotlib.patches import Rectangle

            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="0.3", lw=0))
    hatched = int(flagged.sum())
    note = f"\nhatched: IQR > {NOISE_THRESHOLD:.0%} of the value (noisy, {hatched})" if hatched else ""
    ax.set_title(label + note, fontsize=9 if hatched else 10)
    fig.colorbar(image, ax=ax, shrink=0.8)
    return hatched


def plot_heatmaps(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Heatmaps over the ``num_terms × low_rank`` grid of every metric the sweep has
    (speed-ups, memory ratio, errors per init, anchor speed-up, roofline fraction, task
    accuracy); each timed cell shows its IQR, and cells whose IQR exceeds
    :data:`~panther_lite.benchmark.analysis.NOISE_THRESHOLD` × their value are hatched and
    counted in the title. Saves a PNG at ``path`` and returns it."""
    sketched = _sketched(df)
    panels = [p for p in _HEATMAPS if p[0] in sketched and sketched[p[0]].notna().any()]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = new_figure(figsize=(4.6 * ncols, 3.8 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    hatched = sum(_draw_heatmap(fig, ax, sketched, *panel) for ax, panel in zip(axes.flat, panels))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    note = f"\n{hatched} noisy cells hatched: not results; re-measure on a quieter machine" if hatched else ""
    fig.suptitle(_title(df) + note, fontsize=11)
    return save_figure(fig, path)


def plot_tradeoff(df: pd.DataFrame, path: Union[str, Path]) -> Path:
    """Relative output error against forward time, one series per init, each point with its
    forward time's IQR as a horizontal bar, each init's Pareto front drawn and marked, and the
    dense layer's time as a line; configurations with a noisy timing
    (:func:`~panther_lite.benchmark.analysis.noisy_rows`) are drawn as grey crosses and kept
    off the front. Saves a PNG at ``path`` and returns it."""
    sketched = _sketched(df).assign(noisy=lambda frame: noisy_rows(frame))
    fig = new_figure(figsize=(7.5, 5))
    ax = fig.subplots()
    for init, colour, label_offset in zip(COMPARED_INITS, ("tab:orange", "tab:blue"), ((5, 6), (5, -12))):
        column = f"error_{init}"
        points = sketched[["forward_ms", "forward_iqr_ms", column, "num_terms", "low_rank", "noisy"]]
        points = points.dropna(subset=["forward_ms", column])
        if points.empty:
            continue
        steady, shaky = points[~points["noisy"]], points[points["noisy"]]
        ax.errorbar(steady["forward_ms"], steady[column], xerr=steady["forward_iqr_ms"].fillna(0) / 2, fmt="o",
                    color=colour, alpha=0.45, elinewidth=1, label=f"init='{init}' (bar: IQR of the time)")
        if not shaky.empty:
            ax.scatter(shaky["forward_ms"], shaky[column], marker="x", color="0.5",
                       label=f"init='{init}', noisy timing (IQR > {NOISE_THRESHOLD:.0%}): off the front")
        front = points[pareto_front(points["forward_ms"], points[column], excluded=points["noisy"])]
        front = front.sort_values("forward_ms")
        ax.plot(front["forward_ms"], front[column], "-o", color=colour, markerfacecolor="none", markersize=11,
                label=f"Pareto front, init='{init}'")
        _label_front(ax, front, column, label_offset)
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


def _label_front(ax, front: pd.DataFrame, column: str, offset) -> None:
    """``L=…,k=…`` beside the points of a front, skipping a point whose neighbour is labelled."""
    labelled = []
    for _, p in front.iterrows():
        where = (math.log10(p["forward_ms"]), math.log10(max(p[column], 1e-30)))
        if any(abs(where[0] - x) < 0.12 and abs(where[1] - y) < 0.2 for x, y in labelled):
            continue
        labelled.append(where)
        ax.annotate(f"L={int(p['num_terms'])},k={int(p['low_rank'])}", (p["forward_ms"], p[column]),
                    textcoords="offset points", xytext=offset, fontsize=7)


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
