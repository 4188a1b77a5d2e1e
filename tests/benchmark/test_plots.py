"""Plots: the sweep's heatmaps and trade-off are written without pyplot, show the timings'
spread and never present noise as a result, and a rerun never leaves the previous run's plots
beside a CSV they do not show."""
from __future__ import annotations

import sys
from pathlib import Path

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


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, instead of PNGs."""
    from panther_lite.benchmark import plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kwargs: figures.append(fig) or Path(path))
    return figures


def _with_a_noisy_fast_cell(df):
    """The L=2 k=4 row made the fastest and most accurate, with a speed-up IQR of 10× its median."""
    row = df.index[(df["num_terms"] == 2) & (df["low_rank"] == 4)][0]
    df.loc[row, ["forward_ms", "error_svd", "error_sketch"]] = [1e-6, 1e-9, 1e-9]
    df.loc[row, ["forward_iqr_ms", "speedup_iqr"]] = [0.6e-6, 10 * df.loc[row, "speedup"]]
    return df


def test_heatmaps_show_each_timings_iqr_and_hatch_the_noisy_cells(tiny_sweep, drawn, tmp_path):
    from matplotlib.patches import Rectangle

    plot_heatmaps(_with_a_noisy_fast_cell(tiny_sweep()), tmp_path / "h.png")
    (fig,) = drawn
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title()}
    speedup = panels["forward speed-up over dense (×)"]
    hatched = [patch for ax in fig.axes for patch in ax.patches if isinstance(patch, Rectangle) and patch.get_hatch()]
    assert len(hatched) == 1 and hatched[0] in speedup.patches and hatched[0].get_xy() == (0.5, 0.5)  # L=2 k=4
    assert "hatched: IQR > 50% of the value (noisy, 1)" in speedup.get_title()
    assert "1 noisy cells hatched" in fig._suptitle.get_text()
    assert all("IQR" in text.get_text() for text in speedup.texts)
    assert not any("IQR" in text.get_text() for text in panels["memory / dense memory"].texts)  # not timed


def test_the_tradeoff_keeps_a_noisy_point_off_the_front_and_shows_time_spreads(tiny_sweep, drawn, tmp_path):
    df = _with_a_noisy_fast_cell(tiny_sweep())
    plot_tradeoff(df, tmp_path / "t.png")
    (fig,) = drawn
    ax = fig.axes[0]
    fronts = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("Pareto front")}
    assert fronts and all(1e-6 not in line.get_xdata() for line in fronts.values())
    legend = [text.get_text() for text in ax.get_legend().texts]
    assert "init='svd', noisy timing (IQR > 50%): off the front" in legend
    assert "init='svd' (bar: IQR of the time)" in legend


def test_a_noisy_cell_does_not_set_the_colour_scale(tiny_sweep, drawn, tmp_path):
    df = _with_a_noisy_fast_cell(tiny_sweep())
    noisy = (df["num_terms"] == 2) & (df["low_rank"] == 4)
    df.loc[noisy, ["speedup", "speedup_iqr"]] = [1e6, 1e7]  # an absurd reading, with its spread
    plot_heatmaps(df, tmp_path / "h.png")
    (speedup,) = [ax for ax in drawn[0].axes if ax.get_title().startswith("forward speed-up")]
    steady = df.loc[(df["method"] == "sketched") & ~noisy, "speedup"]
    assert speedup.images[0].get_clim() == (steady.min(), steady.max())
