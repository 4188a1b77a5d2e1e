"""The plot of a conversion report: rank and error of every selected layer, in model order
(a pyplot-free figure, so no display is needed and no backend changes)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Union

import numpy as np
import pandas as pd

from ..figures import new_figure, save_figure
from .records import CONVERTED

__all__ = ["plot_conversion_report"]

_MAX_LABELLED_LAYERS = 60  # beyond this, tick labels would overlap: label every n-th layer


def plot_conversion_report(report: pd.DataFrame, path: Union[str, Path], title: str = "") -> Path:
    """Two panels over the rows of a :func:`~panther_lite.convert` report: the rank ``2·L·k``
    of each converted layer (layers kept dense or skipped shown as gaps, their status in
    grey below the axis), and its relative weight and output errors on a log scale. Saves a
    PNG at ``path`` and returns it."""
    positions = np.arange(len(report))
    converted = (report["status"] == CONVERTED).to_numpy()
    rank = (2 * report["num_terms"] * report["low_rank"]).astype("Float64").fillna(0).to_numpy(dtype=float)
    width = min(max(6.0, 0.18 * len(report) + 2.0), 24.0)
    fig = new_figure(figsize=(width, 6.5))
    rank_ax, error_ax = fig.subplots(2, 1, sharex=True)
    rank_ax.bar(positions[converted], rank[converted], color="tab:blue", label="converted: rank 2·L·k")
    for x in positions[~converted]:
        rank_ax.axvspan(x - 0.4, x + 0.4, color="0.85", lw=0)
    rank_ax.set_ylabel("rank 2·L·k")
    rank_ax.set_title(textwrap.fill(title or report.attrs.get("summary", ""), int(13 * width)), fontsize=8)
    handles, _ = rank_ax.get_legend_handles_labels()
    if (~converted).any():
        from matplotlib.patches import Patch

        handles.append(Patch(color="0.85", label="kept dense or skipped"))
    rank_ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1))
    for column, marker, colour in (("output_error", "o", "tab:red"), ("weight_error", "s", "tab:orange")):
        values = report[column].to_numpy(dtype=float)
        shown = converted & np.isfinite(values) & (values > 0)
        if shown.any():
            error_ax.plot(positions[shown], values[shown], marker, color=colour, label=column.replace("_", " "))
    error_ax.set_yscale("log")
    error_ax.set_ylabel("relative error")
    error_ax.grid(True, which="both", axis="y", alpha=0.3)
    if error_ax.get_legend_handles_labels()[0]:
        error_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1))
    step = max(1, -(-len(report) // _MAX_LABELLED_LAYERS))
    error_ax.set_xticks(positions[::step], list(report["name"])[::step], rotation=90, fontsize=6)
    error_ax.set_xlim(-0.6, len(report) - 0.4)
    return save_figure(fig, path)
