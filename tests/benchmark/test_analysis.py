"""The Pareto front: undominated points, and never a point that was not measured (NaN)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.benchmark import pareto_front


def test_pareto_front_of_a_known_set():
    times = [1.0, 2.0, 3.0, 2.5, 1.0]
    errors = [0.5, 0.3, 0.1, 0.4, 0.6]
    assert pareto_front(times, errors).tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError, match="1-D of one length"):
        pareto_front([1.0], [1.0, 2.0])


def test_a_point_with_a_nan_time_or_error_is_never_optimal():
    nan = math.nan
    assert pareto_front([nan, 2.0, 1.0], [0.1, 0.3, 0.5]).tolist() == [False, True, True]
    assert pareto_front([1.0, 2.0], [nan, 0.3]).tolist() == [False, True]
    assert pareto_front([nan], [nan]).tolist() == [False]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*range(10), math.nan]), st.integers(0, 9)), min_size=1, max_size=15))
def test_pareto_front_points_are_measured_undominated_and_dominate_the_rest(points):
    t, e = np.array(points, dtype=float).T
    front = pareto_front(t, e)
    measured = [j for j in range(len(t)) if not np.isnan(t[j])]
    dominates = lambda i, j: t[i] <= t[j] and e[i] <= e[j] and (t[i] < t[j] or e[i] < e[j])  # noqa: E731
    for j in range(len(t)):
        if j not in measured:
            assert not front[j]
            continue
        dominated = any(dominates(i, j) for i in measured)
        assert front[j] == (not dominated)
        if not front[j]:
            assert any(front[i] and dominates(i, j) for i in measured)
