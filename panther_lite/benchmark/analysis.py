"""Reading sweep results: the Pareto front of error against time."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def pareto_front(times: Sequence[float], errors: Sequence[float]) -> np.ndarray:
    """Boolean mask of the points no other point dominates (both time and error lower or
    equal, one strictly lower): the best accuracy-versus-time trade-offs.

    A point with a NaN time or error (not measured) is never on the front, and it
    dominates nothing.
    """
    t = np.asarray(times, dtype=float)
    e = np.asarray(errors, dtype=float)
    if t.shape != e.shape or t.ndim != 1:
        raise ValueError(f"times and errors must be 1-D of one length, got shapes {t.shape} and {e.shape}")
    measured = ~(np.isnan(t) | np.isnan(e))
    no_worse = (t[None, :] <= t[:, None]) & (e[None, :] <= e[:, None])
    better = (t[None, :] < t[:, None]) | (e[None, :] < e[:, None])
    return measured & ~(no_worse & better).any(axis=1)
