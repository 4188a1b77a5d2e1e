"""``tune``: the smallest global budget whose score stays within a tolerance of the dense score.

The search variable is ``param_ratio`` of a global allocation (:mod:`.allocation`), searched
in ``log(param_ratio)`` because what matters is the ratio between sizes. The score is assumed
to grow with the budget (more rank never fits worse), so the passing budgets form an interval
``[ρ*, 1]``: the search keeps a bracket ``(failing, passing)``, first tries the bottom of
the range, then bisects the bracket in log space until its ends are within ``resolution``
(relative) of each other. With the default range (1% to 100%) and resolution (3%) that is at
most 10 evaluations of the converted model, where a grid at the same resolution takes 157.
Each trial converts the model in place and undoes the swap afterwards, so the dense layers are
never touched; the model is left converted at ``ρ*`` only once the search has succeeded.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ..extras import require
from .allocation import BudgetTooSmall
from .calibration import reiterable
from .surgery import undo_swaps

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["tune", "plot_search", "SearchStep", "bisect_budget"]

TRACE_COLUMNS = ["budget", "score", "stored_params", "stored_ratio", "seconds", "passed"]


@dataclass(frozen=True)
class SearchStep:
    """One evaluated budget: the score, the whole model's stored entries (U buffers included)
    and the seconds the conversion and the evaluation took."""

    budget: float
    score: float
    stored_params: int
    seconds: float
    passed: bool


def _check_number(name: str, value, low: float, high: float, closed_low: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low <= value if closed_low else low < value) or value > high:
        bracket = "[" if closed_low else "("
        raise ValueError(f"{name} must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def bisect_budget(
    trial: Callable[[float], bool], low: float, high: float, *, resolution: float, max_evaluations: int
) -> Optional[float]:
    """The smallest budget in ``[low, high]`` for which ``trial`` passes, to within a factor
    ``1 + resolution``; ``high`` is assumed to pass and is not tried. Returns None when the
    search ends without a passing trial (then ``high`` is the answer)."""
    if trial(low):
        return low
    failing, passing, found = low, high, None
    for _ in range(max_evaluations - 1):
        if passing / failing <= 1 + resolution:
            break
        middle = math.sqrt(failing * passing)
        if trial(middle):
            passing, found = middle, middle
        else:
            failing = middle
    return found


def _search_trace(steps: List[SearchStep], dense_stored: int) -> "pd.DataFrame":
    import pandas as pd

    rows = [
        dict(
            budget=s.budget,
            score=s.score,
            stored_params=s.stored_params,
            stored_ratio=s.stored_params / max(dense_stored, 1),
            seconds=s.seconds,
            passed=s.passed,
        )
        for s in steps
    ]
    return pd.DataFrame(rows, columns=TRACE_COLUMNS)


def plot_search(report: "pd.DataFrame", ax=None):
    """Score against the whole model's stored size for every budget :func:`tune` tried
    (the dense model at ratio 1, the chosen budget marked). Returns the matplotlib Axes;
    without ``ax`` a new pyplot-free figure is made (``ax.figure.savefig(...)`` to save)."""
    trace = report.attrs["search"]
    if ax is None:
        Figure = require("matplotlib.figure", "plot_search").Figure

        ax = Figure(figsize=(5, 3.5)).subplots()
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


def _check_tune_arguments(
    model, evaluate, tolerance, ratio_range, resolution, max_evaluations, convert_kwargs
) -> Tuple[float, float]:
    """Validate tune's own arguments; returns the ``(low, high)`` budgets searched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(evaluate):
        raise TypeError(f"evaluate must be a callable evaluate(model) -> float (higher is better), got {evaluate!r}")
    _check_number("tolerance", tolerance, 0.0, math.inf)
    chosen = sorted({"param_ratio", "low_rank", "rank_pattern"} & set(convert_kwargs))
    if chosen:
        raise ValueError(f"tune chooses the budget itself: drop {chosen} (num_terms and other convert arguments are fine)")
    if not (isinstance(ratio_range, (tuple, list)) and len(ratio_range) == 2):
        raise ValueError(f"ratio_range must be a (low, high) pair of budgets in (0, 1], got {ratio_range!r}")
    low = _check_number("ratio_range low", ratio_range[0], 0.0, 1.0, closed_low=False)
    high = _check_number("ratio_range high", ratio_range[1], low, 1.0, closed_low=False)
    _check_number("resolution", resolution, 0.0, math.inf, closed_low=False)
    if isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int) or max_evaluations < 1:
        raise ValueError(f"max_evaluations must be an integer >= 1, got {max_evaluations!r}")
    data = convert_kwargs.get("calibration_data")
    if data is not None and not callable(data) and not reiterable(data):
        raise TypeError(
            "tune converts the model once per trial, each time running calibration_data: pass a list of batches, "
            f"a DataLoader or a callable, not a one-shot iterator ({type(data).__name__}) that only the first "
            "trial would see"
        )
    return low, high


def _score(evaluate, model: nn.Module) -> float:
    """``evaluate(model)`` as a float: a Python or NumPy real number or a one-element tensor."""
    score = evaluate(model)
    if isinstance(score, torch.Tensor) and score.numel() == 1 and not score.dtype.is_complex:
        score = score.item()
    if isinstance(score, (bool, np.bool_)) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise TypeError(f"evaluate(model) must return a finite number (higher is better), got {score!r}")
    return float(score)


def tune(
    model: nn.Module,
    evaluate: Callable[[nn.Module], float],
    *,
    tolerance: float,
    calibration_data=None,
    ratio_range: Tuple[float, float] = (0.01, 1.0),
    resolution: float = 0.03,
    max_evaluations: int = 12,
    progress: Optional[bool] = None,
    **convert_kwargs,
) -> "pd.DataFrame":
    """Convert ``model`` in place at the smallest global budget whose score stays within
    ``tolerance`` of the dense model's.

    Args:
        model: the dense model (modified in place only once the search succeeded).
        evaluate: ``evaluate(model) -> float``, higher is better (e.g. accuracy on held-out
            data; a NumPy number or a one-element tensor is fine). Called once on the dense
            model, then once per tried budget. A trial that converts no layer (every layer
            kept dense, e.g. below uniform's per-layer minimum) never passes.
        tolerance: how much score may be lost: a budget passes when
            ``evaluate(converted) >= evaluate(dense) - tolerance``.
        calibration_data: as for :func:`~panther_lite.convert` (recommended: the fits then
            keep what the layers compute on real inputs); run once per trial, so a list, a
            DataLoader or a callable, not a one-shot iterator (TypeError).
        ratio_range: ``(low, high)`` budgets searched (the whole selected layers' stored size
            as a fraction of dense); ``high`` is assumed to pass (1: everything dense).
        resolution: the search stops when the smallest passing and the largest failing
            budget are within this relative distance.
        max_evaluations: at most this many converted models are evaluated.
        progress: tqdm bars (None: on a terminal only).
        **convert_kwargs: passed to :func:`~panther_lite.convert` (``target_modules``,
            ``num_terms``, ``sequential``, ``allocation`` — default ``"global"`` — ...);
            not the sizes, which tune chooses.

    Returns:
        The report of the final :func:`~panther_lite.convert` (all layers "kept dense" when
        no budget below ``high`` passed), with ``attrs["search"]``: a DataFrame of every
        evaluation (``budget``, ``score``, ``stored_params`` and ``stored_ratio`` of the whole
        model, ``seconds``, ``passed``; budget 1 is the dense model), ``attrs["tune_budget"]``
        and ``attrs["tune_threshold"]``. :func:`plot_search` draws score against size.

    Raises:
        Whatever ``evaluate`` or ``convert`` raise; the model is then unchanged.
    """
    from .api import convert_undoable
    from .surgery import stored_numel

    checked = dict(convert_kwargs, calibration_data=calibration_data)
    low, high = _check_tune_arguments(model, evaluate, tolerance, ratio_range, resolution, max_evaluations, checked)
    convert_kwargs.setdefault("allocation", "global")
    convert_kwargs.update(calibration_data=calibration_data, progress=False)  # tune shows one bar of its own
    start = time.perf_counter()
    dense_score = _score(evaluate, model)
    dense_stored = stored_numel(model)
    steps = [SearchStep(1.0, dense_score, dense_stored, time.perf_counter() - start, True)]
    threshold = dense_score - tolerance
    bar = _progress(max_evaluations, progress)
    best = {}  # the smallest passing budget's report and (parent, name, new module) swaps

    def trial(budget: float) -> bool:
        began = time.perf_counter()
        report, log = convert_undoable(model, param_ratio=budget, **convert_kwargs)
        try:
            score, stored = _score(evaluate, model), stored_numel(model)
            swaps = [(parent, child, getattr(parent, child)) for parent, child, _ in log]
        finally:
            undo_swaps(log)
        passed = score >= threshold and bool((report["status"] == "converted").any())  # all dense: no pass
        steps.append(SearchStep(budget, score, stored, time.perf_counter() - began, passed))
        if passed:
            best.update(report=report, swaps=swaps)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(budget=f"{budget:.3f}", score=f"{score:.4g}")
        return passed

    try:
        try:
            found = bisect_budget(trial, low, high, resolution=resolution, max_evaluations=max_evaluations)
        except BudgetTooSmall as error:  # only the bottom of the range can be: start from the smallest plan
            low = min(high, error.minimum_ratio * (1 + 1e-9))
            found = bisect_budget(trial, low, high, resolution=resolution, max_evaluations=max_evaluations)
    finally:
        if bar is not None:
            bar.close()
    budget = high if found is None else found
    if found is None:
        report, _ = convert_undoable(model, param_ratio=budget, **convert_kwargs)
    else:  # put the passing trial's fitted layers back instead of fitting them again
        report = best["report"]
        for parent, child, new in best["swaps"]:
            setattr(parent, child, new)
    report.attrs.update(search=_search_trace(steps, dense_stored), tune_budget=budget, tune_threshold=threshold)
    return report


def _progress(total: int, progress: Optional[bool]):
    """A tqdm bar over the evaluations, or None (no bar: tqdm is not imported)."""
    import sys

    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="tune", unit="evaluation")
