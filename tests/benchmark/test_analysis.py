"""The Pareto front: undominated points, never a point that was not measured (NaN) or was
excluded; timings too noisy to read, found by their spread against their median."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from panther_lite.benchmark import noise_note, noisy, noisy_rows, pareto_front, relative_spread


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


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.booleans()), min_size=1, max_size=15))
def test_an_excluded_point_is_never_on_the_front_and_dominates_nothing(points):
    t, e, out = (np.array(column) for column in zip(*points))
    front = pareto_front(t.astype(float), e.astype(float), excluded=out)
    kept = np.flatnonzero(~out)
    assert not front[out].any()
    assert front[kept].tolist() == pareto_front(t[kept].astype(float), e[kept].astype(float)).tolist()


def _noisy_sweep(tiny_sweep):
    """The tiny sweep with the L=2 k=4 row made the fastest and most accurate, but with a
    speed-up IQR of 10× its median and a forward-time IQR of 0.6× its median."""
    df = tiny_sweep()
    row = df.index[(df["num_terms"] == 2) & (df["low_rank"] == 4)][0]
    df.loc[row, ["forward_ms", "error_svd", "error_sketch"]] = [1e-6, 1e-9, 1e-9]
    df.loc[row, "forward_iqr_ms"] = 0.6e-6
    df.loc[row, "speedup_iqr"] = 10 * df.loc[row, "speedup"]
    return df, row


def test_noisy_timings_are_found_by_their_spread_against_their_median(tiny_sweep):
    df, row = _noisy_sweep(tiny_sweep)
    assert relative_spread(df, "speedup")[row] == pytest.approx(10)
    assert relative_spread(df, "forward_ms")[row] == pytest.approx(0.6)
    assert relative_spread(df, "error_svd").isna().all()  # errors are not timed
    assert noisy(df, "speedup").tolist() == [i == row for i in df.index]
    assert noisy(df, "forward_ms").tolist() == [i == row for i in df.index]
    assert not noisy(df, "forward_ms", threshold=0.7).any()
    assert noisy_rows(df).tolist() == [i == row for i in df.index]
    note = noise_note(df)
    assert note.startswith("1 of 4 configurations have a timing whose IQR exceeds 50% of its median")
    assert "worst: L=2 k=4, speedup with IQR" in note and "re-measure" in note
    assert noise_note(tiny_sweep()) is None  # one repeat: no spread at all
