"""Fixtures of the measurement-library tests: a fake clock (timing tests never depend on
the machine's load), the benchmark scripts loaded as modules, stand-in plots and a tiny sweep."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from panther_lite.benchmark import LinearCase, run_sweep, timing


class FakeClock:
    """Replaces the CPU clock of :mod:`panther_lite.benchmark.timing`: each read returns
    the time so far, and a timed call takes ``cost()`` ms — set it from inside the timed
    callables (``clock.advance(ms)``) or by ``load`` (a factor applied to every advance)."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.load = 1.0

    def advance(self, ms: float) -> None:
        self.now_ms += ms * self.load

    def __call__(self) -> float:
        return self.now_ms / 1e3


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(timing, "_clock", clock)
    return clock


@pytest.fixture
def load_script(repo_root: Path) -> Callable:
    """``load_script("benchmarks/sweep.py")``: a script of the checkout as a module (its
    ``main(argv)`` can then run in-process)."""

    def load(relative: str):
        path = repo_root / relative  # an absolute path stays as it is
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def quick_plots(monkeypatch) -> list:
    """Sweep plots drawn as tiny stand-in files (drawing them for real takes seconds; the
    plots themselves are tested in test_plots.py); returns the paths drawn, in order."""
    from panther_lite.benchmark import plots

    drawn = []

    def draw(df, path):
        drawn.append(Path(path))
        Path(path).write_bytes(b"png of %d rows" % len(df))
        return Path(path)

    monkeypatch.setattr(plots, "plot_heatmaps", draw)
    monkeypatch.setattr(plots, "plot_tradeoff", draw)
    return drawn


@pytest.fixture
def tiny_sweep(tmp_path) -> Callable[..., pd.DataFrame]:
    """A 24→16 linear sweep, batch 4, over L ∈ {1, 2} × k ∈ {2, 4}, into ``tmp_path/sweep.csv``."""

    def sweep(**kwargs) -> pd.DataFrame:
        options = dict(warmup=0, repeats=1, progress=False, csv_path=tmp_path / "sweep.csv")
        options.update(kwargs)
        return run_sweep(LinearCase(24, 16, 4), [1, 2], [2, 4], **options)

    return sweep
