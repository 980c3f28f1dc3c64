"""A ``--time-budget`` run plans once more, at the end of its warm-up, from the steps it has trained.

The first plan (`unison.training.budget`) comes from the few steps timed before the run: 5 on a 2-core CPU,
where they were off by up to a tenth (a 5-minute SimCLR run planned 550 steps of 0.469 s, ran them at 0.43 s
and used 271 s of its 300; another planned 637 and was stopped by the clock at 619, its cosine unfinished).
By the end of the warm-up the run has timed tens of real steps, hooks and data included. `ReplanHook` then
plans the steps again from them (`replanned_steps`, the same rule as the first plan: `plan_steps`) on rank 0,
broadcasts the count, and `unison.training.step.apply_plan` plans the cosine and the method's schedules for it.

* The learning rate up to that step is the same in both plans (the warm-up is kept, the cosine has not
  started), so the run trains what a run planned for the new count from the start would, except that the
  method's own schedules (momentum, teacher temperature) follow their new length from this step on.
* It happens once, in the attempt that measured: ``config.json`` and the checkpoints record the new plan, with
  the first count and why it changed (``replanned``), and a resumed run keeps it.
* The clock still ends a run whose steps turn slower later (`unison.training.budget.BudgetClock`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from unison.distributed import collectives as C
from unison.training import budget as clocks  # its `clock`, read at each call (a test skews it)
from unison.training.budget import BudgetClock, BudgetCosts, Cadence, cadence_of, plan_steps, sync_device
from unison.training.hooks import StepEnd, TrainHook
from unison.training.step import Run, apply_plan

REPLAN_SHARE = 0.1     # re-plan at the end of the warm-up, and no earlier than this share of the first plan
MIN_TIMED_STEPS = 5    # fewer real steps before that point than this: the first plan stays


def replan_step(plan: dict[str, Any]) -> int | None:
    """The step after which `plan` is planned again (None: too few steps to time, or already re-planned)."""
    at = max(int(plan["warmup_steps"]), math.ceil(REPLAN_SHARE * int(plan["steps"])))
    if "replanned" in plan or at - 1 < MIN_TIMED_STEPS or at >= int(plan["steps"]):
        return None
    return at


def replanned_steps(budget_s: float, first: BudgetCosts, cadence: Cadence, at: int, spent_s: float, step_s: float,
                    cap: int | None) -> int:
    """The steps that fit when `at` steps are done, `spent_s` of the budget is spent and a step takes `step_s`:
    the first plan's rule, with the time before step 0 re-estimated as what the trained steps do not explain.
    At least ``at + 1``: the clock ends a run that has no time left."""
    costs = replace(first, spent_s=max(0.0, spent_s - at * step_s), step_s=step_s)
    return max(at + 1, plan_steps(budget_s, costs, cadence, cap))


class ReplanHook(TrainHook):
    """Times the steps from the first to `replan_step`, then plans again (every rank takes rank 0's count)."""

    def __init__(self, budget: BudgetClock, say: Callable[[str], None], on_plan: Callable[[], None]) -> None:
        self.budget, self.say, self.on_plan = budget, say, on_plan
        self.at: int | None = None
        self.timed_from = 0.0

    def start(self, run: Run, step: int) -> None:
        plan = run.cfg.time_budget_plan
        planned_here = self.budget.planned_here and step == 0   # a resumed run keeps the plan it has
        self.at = replan_step(plan) if planned_here and plan is not None else None

    def after_step(self, run: Run, end: StepEnd) -> None:
        if self.at is None or end.step not in (1, self.at):
            return
        sync_device(run)
        if end.step == 1:   # the first step is not timed: its first allocations and data start
            self.timed_from = clocks.clock()
            return
        step_s = (clocks.clock() - self.timed_from) / (self.at - 1)
        plan = run.cfg.time_budget_plan
        assert plan is not None, "start() re-plans only a planned run"
        first = BudgetCosts(**plan["measured"])
        steps = replanned_steps(self.budget.budget_s, first, cadence_of(run), self.at, self.budget.spent_s(), step_s,
                                run.cfg.max_steps) if C.rank() == 0 else None
        steps, step_s = C.broadcast_object((steps, step_s) if C.rank() == 0 else None)
        why = (f"re-planned after step {self.at} from {self.at - 1} trained steps of {step_s:.4g} s: {steps} steps "
               f"(first plan: {plan['steps']} steps of {first.step_s:.4g} s)")
        run.cfg.time_budget_plan = {**plan, "steps": steps, "why": f"{why}; first plan: {plan['why']}",
                                    "replanned": {"after_step": self.at, "first_steps": plan["steps"],
                                                  "step_s": round(step_s, 6)}}
        apply_plan(run)
        self.at = None
        self.on_plan()
        self.say(f"time budget {run.cfg.time_budget}: {why}")
