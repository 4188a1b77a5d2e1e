"""StepBudget, the plan behind distill's max_minutes: the steps that fit at the pace measured so far,
never raised again, never below those taken, the first process's plan on every process (the
end-to-end behaviour is in test_distillation.py)."""
import pytest

from panther_lite.conversion.distilling import step_budget as budget_module
from panther_lite.conversion.distilling.step_budget import StepBudget, check_max_minutes


@pytest.mark.parametrize("plans, expected", [
    ([(10, 30.0)], 20),               # 3 s a step: 20 fit in a minute
    ([(10, 30.0), (20, 40.0)], 20),   # faster later: never raised again
    ([(10, 120.0)], 10),              # already past the limit: never below the steps taken
    ([(10, 0.0)], 1000),              # no time measured: nothing to plan from
])
def test_a_plan_lowers_the_steps_to_what_fits_and_never_raises_them(plans, expected):
    ticks = iter([0.0, *(seconds for _, seconds in plans)])
    budget = StepBudget(1000, max_minutes=1, clock=lambda: next(ticks))
    for taken, _ in plans:
        budget.plan(taken)
    assert budget.steps == expected and budget.lowered == (expected < 1000)


def test_every_process_takes_the_first_process_plan(monkeypatch):
    asked = []
    monkeypatch.setattr(budget_module, "from_first_process", lambda value, what: asked.append((value, what)) or 7)
    ticks = iter([0.0, 30.0])
    budget = StepBudget(1000, max_minutes=1, clock=lambda: next(ticks))
    budget.plan(10)
    assert asked == [(20, "the distillation steps that fit in max_minutes")] and budget.steps == 7


def test_without_a_limit_the_steps_stay_and_the_clock_is_read_only_at_the_start():
    reads = []
    budget = StepBudget(50, max_minutes=None, clock=lambda: reads.append(1) or 0.0)
    budget.plan(10)
    assert (budget.steps, budget.lowered, len(reads)) == (50, False, 1)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True, [5]])
def test_a_limit_that_is_not_a_positive_number_of_minutes_is_named(value):
    with pytest.raises(ValueError, match="max_minutes must be a finite number of minutes > 0 or None"):
        check_max_minutes(value)
