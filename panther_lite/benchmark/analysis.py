"""Reading sweep results: how far each timing can be trusted (its spread against its median),
and the Pareto front of error against time over the timings that can."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd

__all__ = ["NOISE_THRESHOLD", "SPREAD_COLUMNS", "pareto_front", "relative_spread", "noisy", "noisy_rows", "noise_note"]

NOISE_THRESHOLD = 0.5
"""A timing whose interquartile range exceeds this fraction of its median is *noisy*: the
machine was too busy for it (on a quiet machine the sweep's spreads stay under 0.2)."""

SPREAD_COLUMNS = {
    "forward_ms": "forward_iqr_ms",
    "forward_backward_ms": "forward_backward_iqr_ms",
    "speedup": "speedup_iqr",
    "speedup_forward_backward": "speedup_forward_backward_iqr",
    "anchor_speedup": "anchor_speedup_iqr",
    "roofline_fraction": "forward_iqr_ms",  # roofline time / forward time: the forward time's spread
}
"""Each timed column of a sweep and the IQR column of its spread (``roofline_fraction``'s
relative spread is that of ``forward_ms``)."""


def relative_spread(df: pd.DataFrame, column: str) -> pd.Series:
    """IQR / median of ``column`` per row (NaN where either is missing, or the column has no
    spread: errors and memory are not timed)."""
    spread = SPREAD_COLUMNS.get(column)
    if spread is None or spread not in df or column not in df:
        return pd.Series(np.nan, index=df.index)
    median = df["forward_ms" if column == "roofline_fraction" else column].astype(float)
    return df[spread].astype(float) / median.abs()


def noisy(df: pd.DataFrame, column: str, threshold: float = NOISE_THRESHOLD) -> pd.Series:
    """Boolean per row: ``column``'s IQR exceeds ``threshold`` × its median."""
    return (relative_spread(df, column) > threshold).fillna(False).astype(bool)


def noisy_rows(df: pd.DataFrame, threshold: float = NOISE_THRESHOLD) -> pd.Series:
    """Boolean per row: any of its timings (forward, forward+backward, their speed-ups, the
    anchor speed-up) is :func:`noisy`; such a row must not be recommended or put on a front."""
    flags = [noisy(df, column, threshold) for column in SPREAD_COLUMNS if column != "roofline_fraction"]
    return pd.concat(flags, axis=1).any(axis=1) if flags else pd.Series(False, index=df.index)


def noise_note(df: pd.DataFrame, threshold: float = NOISE_THRESHOLD) -> Optional[str]:
    """One line on the sketched rows whose timings are noisy (the worst named), or None."""
    sketched = df[df["method"] == "sketched"] if "method" in df else df
    flagged = noisy_rows(sketched, threshold)
    if not flagged.any():
        return None
    spreads = pd.DataFrame({column: relative_spread(sketched, column) for column in SPREAD_COLUMNS})
    index, worst = spreads.stack().idxmax()
    row = sketched.loc[index]
    median = row["forward_ms" if worst == "roofline_fraction" else worst]
    return (
        f"{int(flagged.sum())} of {len(sketched)} configurations have a timing whose IQR exceeds {threshold:.0%} "
        f"of its median (worst: L={int(row['num_terms'])} k={int(row['low_rank'])}, {worst} with IQR "
        f"{row[SPREAD_COLUMNS[worst]]:.3g} around {median:.3g}): the machine was busy. They are hatched "
        "in the heatmaps and left off the Pareto front and any recommendation; re-measure them on a quieter machine "
        "or with more repeats"
    )


def pareto_front(
    times: Sequence[float], errors: Sequence[float], *, excluded: Optional[Sequence[bool]] = None
) -> np.ndarray:
    """Boolean mask of the points no other point dominates (both time and error lower or
    equal, one strictly lower): the best accuracy-versus-time trade-offs.

    A point with a NaN time or error (not measured), or marked in ``excluded`` (a noisy
    timing, say), is never on the front, and it dominates nothing.
    """
    t = np.asarray(times, dtype=float)
    e = np.asarray(errors, dtype=float)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"times and errors must be 1-D of one length, got shapes {t.shape} and {e.shape}")
    measured = ~(np.isnan(t) | np.isnan(e))
    if excluded is not None:
        out = np.asarray(excluded, dtype=bool)
        if out.shape != t.shape:
            raise ValueError(f"excluded must have the shape of times {t.shape}, got {out.shape}")
        measured &= ~out
    no_worse = (t[None, :] <= t[:, None]) & (e[None, :] <= e[:, None])
    better = (t[None, :] < t[:, None]) | (e[None, :] < e[:, None])
    return measured & ~(no_worse & better & measured[None, :]).any(axis=1)
