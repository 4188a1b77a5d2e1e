"""How many steps a distillation takes: ``max_steps``, lowered to what fits in ``max_minutes`` as the steps are timed.

A step's time depends on the machine (SmolLM2-135M's takes 4.9 s under bfloat16 autocast on a
2-core CPU with AVX512-BF16 and 14–16 s in float32 on one with AVX2 only), so a step count alone
cannot bound a command's time. With ``max_minutes`` the distillation times its own steps (its held-back
evaluations included) and plans to take only as many as fit, so that its learning-rate schedule
still decays to 0 at the last step it takes, instead of stopping part-way at a high rate.
"""
from __future__ import annotations

import math
import time
from typing import Optional

from ...nn.validation import is_real
from ..process_groups.run import from_first_process

__all__ = ["StepBudget", "check_max_minutes"]


def check_max_minutes(value) -> Optional[float]:
    """``value`` as a float > 0, or None (no time limit); ValueError naming ``max_minutes`` otherwise.

    Examples:
        >>> check_max_minutes(25), check_max_minutes(None)
        (25.0, None)
    """
    if value is None:
        return None
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"distill: max_minutes must be a finite number of minutes > 0 or None, got {value!r}")
    return float(value)


class StepBudget:
    """The step the distillation plans to stop at (``steps``): ``max_steps``, or fewer when ``max_minutes``
    would not hold them at the pace measured so far (:meth:`plan`). ``clock`` is read once when the
    budget is made (the training loop starts) and at each :meth:`plan`.

    Example:
        >>> ticks = iter([0.0, 30.0])  # the loop starts; 10 steps later, 30 s have passed
        >>> budget = StepBudget(1000, max_minutes=1, clock=lambda: next(ticks))
        >>> budget.plan(10)  # 3 s a step: 20 steps fit in a minute
        >>> budget.steps, budget.lowered
        (20, True)
    """

    def __init__(self, max_steps: int, max_minutes: Optional[float], clock=time.perf_counter) -> None:
        self.max_steps = self.steps = max_steps
        self.seconds = None if max_minutes is None else 60.0 * max_minutes
        self.clock = clock
        self.start = clock()

    @property
    def lowered(self) -> bool:
        """Whether the time limit has lowered the steps below ``max_steps``."""
        return self.steps < self.max_steps

    def plan(self, taken: int) -> None:
        """After ``taken`` steps: lower :attr:`steps` to those that fit in the time limit at the pace so
        far (never below ``taken``, never raised again); the first process's plan on every process."""
        if self.seconds is None or taken <= 0:
            return
        elapsed = self.clock() - self.start
        fitting = self.steps if elapsed <= 0 else int(self.seconds * taken / elapsed)
        planned = max(taken, min(self.steps, fitting))
        self.steps = from_first_process(planned, "the distillation steps that fit in max_minutes")
