"""Plots: the sweep's heatmaps and trade-off are written without pyplot, and a rerun never
leaves the previous run's plots beside a CSV they do not show."""
from __future__ import annotations

import sys

import pytest

from panther_lite.benchmark import new_figure, plot_heatmaps, plot_tradeoff, replace_sweep_plots, save_figure


def test_plots_are_written_without_pyplot(tmp_path, tiny_sweep):
    df = tiny_sweep()
    for path in (plot_heatmaps(df, tmp_path / "a" / "h.png"), plot_tradeoff(df, tmp_path / "t.png")):
        assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no sketched rows"):
        plot_heatmaps(df.iloc[:1], tmp_path / "none.png")
    fig = new_figure(figsize=(2, 2))
    fig.subplots().plot([1, 2], [3, 4])
    assert save_figure(fig, tmp_path / "b" / "line.png").stat().st_size > 0
    assert "matplotlib.pyplot" not in sys.modules


def test_replace_sweep_plots_replaces_or_removes_the_previous_runs_plots(tmp_path, tiny_sweep, quick_plots):
    df = tiny_sweep()
    heatmaps, tradeoff = tmp_path / "h.png", tmp_path / "t.png"
    assert replace_sweep_plots(df, heatmaps, tradeoff) == [f"wrote {heatmaps}", f"wrote {tradeoff}"]
    assert replace_sweep_plots(df, heatmaps, tradeoff) == [f"replaced {heatmaps}", f"replaced {tradeoff}"]
    assert quick_plots == [heatmaps, tradeoff] * 2
    lines = replace_sweep_plots(df.iloc[:1], heatmaps, tradeoff)  # a rerun that measured the dense row only
    assert not heatmaps.exists() and not tradeoff.exists()
    assert len(lines) == 2 and all(line.startswith("removed") and "previous run" in line for line in lines)
    assert replace_sweep_plots(df.iloc[:1], heatmaps, tradeoff) == []
