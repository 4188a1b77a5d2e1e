"""Figures without pyplot: a matplotlib ``Figure`` never registered with pyplot (no display
needed, the caller's backend untouched), saving it, and :func:`plot_search`, the plot of a
:func:`~panther_lite.tune` search. matplotlib is imported only inside the functions."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Union

from .extras import require

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["new_figure", "save_figure", "plot_search"]


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


def plot_search(report: "pd.DataFrame", ax=None):
    """Score against the whole model's stored size for every budget :func:`~panther_lite.tune`
    tried (the dense model at ratio 1, the chosen budget marked). Returns the matplotlib Axes;
    without ``ax`` a new pyplot-free figure is made (``ax.figure.savefig(...)`` to save)."""
    trace = report.attrs["search"]
    if ax is None:
        ax = new_figure(figsize=(5, 3.5)).subplots()
    order = trace.sort_values("stored_ratio")
    ax.plot(order["stored_ratio"], order["score"], "o-", color="tab:blue", label="trials")
    threshold = report.attrs["tune_threshold"]
    ax.axhline(threshold, color="tab:red", linestyle="--", label="dense score − tolerance")
    chosen = trace[trace["budget"] == report.attrs["tune_budget"]]
    ax.plot(chosen["stored_ratio"], chosen["score"], "*", color="tab:green", markersize=14, label="chosen")
    ax.set_xlabel("stored size / dense model (U buffers included)")
    ax.set_ylabel("score (higher is better)")
    ax.legend(loc="lower right")
    return ax
