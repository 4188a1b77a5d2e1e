"""``tune``: the smallest global budget whose score stays within a tolerance of the dense score.

The search variable is ``param_ratio`` of a global allocation
(:mod:`~panther_lite.conversion.planning.allocation`), searched in ``log(param_ratio)`` because what matters is the ratio between sizes. The score is assumed
to grow with the budget (more rank never fits worse), so the passing budgets form an interval
``[ρ*, 1]``: the search keeps a bracket ``(failing, passing)``, first tries the bottom of
the range, then bisects the bracket in log space until its ends are within ``resolution``
(relative) of each other. With the default range (1% to 100%) and resolution (3%) that is at
most 10 evaluations of the converted model, where a grid at the same resolution takes 157.
Each trial converts the model in place and undoes the swap afterwards, so the dense layers are
never touched; the model is left converted at ``ρ*`` only once the search has succeeded.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ...nn.validation import check_positive_int, is_real
from ..process_groups.run import from_first_process
from .convert import convert_undoable
from ..calibration.batches import CalibrationData
from ..config import ConvertConfig, make_config
from ..kinds import frozen_types, sketched_types
from ..planning.allocation import BudgetTooSmall
from ..progress import progress_bar
from ..surgery import stored_numel, undo_swaps

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["tune", "SearchStep", "bisect_budget"]

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
    ok = is_real(value) and math.isfinite(value)
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


def _check_tune_arguments(model, evaluate, tolerance, ratio_range, resolution, max_evaluations) -> Tuple[float, float]:
    """Validate tune's own arguments; returns the ``(low, high)`` budgets searched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(evaluate):
        raise TypeError(f"evaluate must be a callable evaluate(model) -> float (higher is better), got {evaluate!r}")
    _check_number("tolerance", tolerance, 0.0, math.inf)
    if not (isinstance(ratio_range, (tuple, list)) and len(ratio_range) == 2):
        raise ValueError(f"ratio_range must be a (low, high) pair of budgets in (0, 1], got {ratio_range!r}")
    low = _check_number("ratio_range low", ratio_range[0], 0.0, 1.0, closed_low=False)
    high = _check_number("ratio_range high", ratio_range[1], low, 1.0, closed_low=False)
    _check_number("resolution", resolution, 0.0, math.inf, closed_low=False)
    check_positive_int("max_evaluations", max_evaluations)
    _warn_if_converted(model)
    return low, high


def _warn_if_converted(model: nn.Module) -> None:
    """tune scores ``model`` as it is for its reference: warn when it already holds sketched or
    frozen layers (a converted model's score is not the dense original's)."""
    converted = [name for name, module in model.named_modules() if isinstance(module, sketched_types() + frozen_types())]
    if converted:
        shown = ", ".join(converted[:3]) + (", ..." if len(converted) > 3 else "")
        warnings.warn(
            f"tune: the model already holds {len(converted)} sketched or frozen layers ({shown}); its score, "
            "the reference tune keeps within tolerance, is that of this converted model, not of the dense "
            "original. Tune a copy of the model taken before convert instead.",
            UserWarning,
            stacklevel=3,
        )


def _trial_config(config: Optional[ConvertConfig], convert_kwargs: dict, high: float) -> ConvertConfig:
    """The config every trial varies (its ``param_ratio``): ``config`` with ``convert_kwargs``
    (``allocation`` "global" unless given), progress bars off; ValueError when it fixes a size."""
    chosen = sorted({"param_ratio", "low_rank", "rank_pattern"} & set(convert_kwargs))
    if config is not None:
        chosen += [name for name in ("low_rank", "rank_pattern") if getattr(config, name) is not None]
    if chosen:
        raise ValueError(f"tune chooses the budget itself: drop {chosen} (num_terms and other convert arguments are fine)")
    if config is None:
        convert_kwargs = {"allocation": "global", **convert_kwargs}
    return make_config(config, {**convert_kwargs, "param_ratio": high, "progress": False}, caller="tune")


def _check_data(calibration_data) -> None:
    data = CalibrationData(calibration_data)
    if data.given and not callable(calibration_data) and not data.reiterable:
        raise TypeError(
            "tune converts the model once per trial, each time running calibration_data: pass a list of batches, "
            f"a DataLoader or a callable, not a one-shot iterator ({type(calibration_data).__name__}) that only the "
            "first trial would see"
        )


def _score(evaluate, model: nn.Module) -> float:
    """``evaluate(model)`` as a float: a Python or NumPy real number or a one-element tensor.
    Across processes every rank evaluates and every rank uses rank 0's score (the same decisions)."""
    score = evaluate(model)
    if isinstance(score, torch.Tensor) and score.numel() == 1 and not score.dtype.is_complex:
        score = score.item()
    score = from_first_process(score, "evaluate(model)'s score")
    if isinstance(score, (bool, np.bool_)) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise TypeError(f"evaluate(model) must return a finite number (higher is better), got {score!r}")
    return float(score)


class _Trials:
    """``trial(budget) -> passed``: convert at ``budget`` (``run``), evaluate, undo; records every
    step and keeps the report and new modules of the smallest passing budget."""

    def __init__(self, model: nn.Module, evaluate, run, threshold: float) -> None:
        self.model, self.evaluate, self.run, self.threshold = model, evaluate, run, threshold
        self.steps: List[SearchStep] = []
        self.bar = None
        self.best_report, self.best_swaps = None, []

    def __call__(self, budget: float) -> bool:
        began = time.perf_counter()
        report, log = self.run(budget)
        try:
            score, stored = _score(self.evaluate, self.model), stored_numel(self.model)
            swaps = [(parent, child, getattr(parent, child)) for parent, child, _ in log]
        finally:
            undo_swaps(log)
        passed = score >= self.threshold and bool((report["status"] == "converted").any())  # all dense: no pass
        self.steps.append(SearchStep(budget, score, stored, time.perf_counter() - began, passed))
        if passed:
            self.best_report, self.best_swaps = report, swaps
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(budget=f"{budget:.3f}", score=f"{score:.4g}")
        return passed


def tune(
    model: nn.Module,
    evaluate: Callable[[nn.Module], float],
    *,
    tolerance: float,
    calibration_data=None,
    config: Optional[ConvertConfig] = None,
    example_inputs=None,
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
            kept dense, e.g. below uniform's per-layer minimum) never passes. Across processes
            (``torchrun``: each trial's conversion runs across them) every process calls it and
            the search uses process 0's score, so every process tries the same budgets; an
            evaluate scoring a shard of the data per process must combine the shards itself
            (``torch.distributed.all_reduce``).
        tolerance: how much score may be lost: a budget passes when
            ``evaluate(converted) >= evaluate(dense) - tolerance``.
        calibration_data, example_inputs: as for :func:`~panther_lite.convert` (calibration
            recommended: the fits then keep what the layers compute on real inputs); run once
            per trial, so a list, a DataLoader or a callable, not a one-shot iterator (TypeError).
        config: a :class:`~panther_lite.ConvertConfig` every trial varies with
            ``dataclasses.replace(config, param_ratio=budget)``; it must not fix ``low_rank``
            or a ``rank_pattern`` (its ``param_ratio`` is replaced).
        ratio_range: ``(low, high)`` budgets searched (the whole selected layers' stored size
            as a fraction of dense); ``high`` is assumed to pass (1: everything dense).
        resolution: the search stops when the smallest passing and the largest failing
            budget are within this relative distance.
        max_evaluations: at most this many converted models are evaluated.
        progress: tqdm bars (None: on a terminal only).
        **convert_kwargs: ConvertConfig options (``target_modules``, ``num_terms``,
            ``sequential``, ``allocation`` — default ``"global"`` without a ``config`` — ...),
            replacing the ``config``'s; not the sizes, which tune chooses.

        Examples:
        >>> import torch, torch.nn as nn, panther_lite
        >>> torch.manual_seed(0) and None
        >>> model, x = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(64, 32)
        >>> reference = model(x).detach()
        >>> score = lambda m: -nn.functional.mse_loss(m(x), reference).item()
        >>> result = panther_lite.tune(model, score, tolerance=0.05, calibration_data=[x])
        >>> 0 < result.attrs["tune_budget"] <= 1
        True

    Returns:
        The report of the final :func:`~panther_lite.convert` (all layers "kept dense" when
        no budget below ``high`` passed), with ``attrs["search"]``: a DataFrame of every
        evaluation (``budget``, ``score``, ``stored_params`` and ``stored_ratio`` of the whole
        model, ``seconds``, ``passed``; budget 1 is the dense model), ``attrs["tune_budget"]``
        and ``attrs["tune_threshold"]``. :func:`~panther_lite.plot_search` draws score against size.

    Raises:
        Whatever ``evaluate`` or ``convert`` raise; the model is then unchanged.
    """
    low, high = _check_tune_arguments(model, evaluate, tolerance, ratio_range, resolution, max_evaluations)
    base = _trial_config(config, convert_kwargs, high)
    _check_data(calibration_data)

    def run(budget: float):
        trial_config = dataclasses.replace(base, param_ratio=budget)
        return convert_undoable(model, trial_config, calibration_data=calibration_data, example_inputs=example_inputs)

    start = time.perf_counter()
    dense_score, dense_stored = _score(evaluate, model), stored_numel(model)
    trials = _Trials(model, evaluate, run, dense_score - tolerance)
    trials.steps.append(SearchStep(1.0, dense_score, dense_stored, time.perf_counter() - start, True))
    trials.bar = progress_bar(None, "tune", "evaluation", progress, total=max_evaluations)
    try:
        try:
            found = bisect_budget(trials, low, high, resolution=resolution, max_evaluations=max_evaluations)
        except BudgetTooSmall as error:  # only the bottom of the range can be: start from the smallest plan
            low = min(high, error.minimum_ratio * (1 + 1e-9))
            found = bisect_budget(trials, low, high, resolution=resolution, max_evaluations=max_evaluations)
    finally:
        if trials.bar is not None:
            trials.bar.close()
    budget = high if found is None else found
    if found is None:
        report, _ = run(budget)
    else:  # put the passing trial's fitted layers back instead of fitting them again
        report = trials.best_report
        for parent, child, new in trials.best_swaps:
            setattr(parent, child, new)
    threshold, steps = trials.threshold, trials.steps
    report.attrs.update(search=_search_trace(steps, dense_stored), tune_budget=budget, tune_threshold=threshold)
    return report
