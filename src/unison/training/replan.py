"""A ``--time-budget`` run plans again from the steps it has trained: once at the end of its warm-up, and late.

The first plan (`unison.training.budget`) comes from the few steps timed before the run: 5 on a 2-core CPU,
where they were off by up to a tenth (a 5-minute SimCLR run planned 550 steps of 0.469 s, ran them at 0.43 s
and used 271 s of its 300; another planned 637 and was stopped by the clock at 619, its cosine unfinished).

* **At the end of the warm-up** the run has timed tens of real steps, hooks and data included. `ReplanHook` then
  plans the steps again from them (`replanned_steps`, the same rule as the first plan: `plan_steps`). The
  learning rate up to that step is the same in both plans (the warm-up is kept, the cosine has not started), so
  the run trains what a run planned for the new count from the start would, except that the method's own
  schedules (momentum, teacher temperature) follow their new length from this step on. It happens once, in the
  attempt that measured (``replanned`` in the plan).
* **Late**, at `LATE_SHARES` of the plan (and in a resumed attempt, which may run on another machine), from the
  steps since the last plan, their periodic work (kNN, checkpoints, epoch starts) included: the steps that fit
  what is left of the budget (`late_steps`). When they differ from the plan by more than `LATE_TOLERANCE` of
  the steps left, the run takes them, and its schedules go on from where they stand to end at the new last step
  (`unison.optim.schedule.Stretch`: no jump in the learning rate, the momentum or the temperature). Without it,
  a run whose steps turned slower mid-way was ended by the clock with its cosine unfinished (an H100 run stopped
  at 87 % of its steps, its learning rate still 4 % of the peak).

Rank 0 decides and broadcasts; every rank applies the plan (`unison.training.step.apply_plan`). ``config.json``
and the checkpoints record each re-plan and why, and a resumed run keeps them. The clock still ends a run whose
steps turn slower after its last check (`unison.training.budget.BudgetClock`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from unison.distributed import collectives as C
from unison.optim.schedule import no_stretch
from unison.training import budget as clocks  # its `clock`, read at each call (a test skews it)
from unison.training.budget import MARGIN_SHARE, BudgetClock, BudgetCosts, Cadence, cadence_of, plan_steps, sync_device
from unison.training.hooks import StepEnd, TrainHook
from unison.training.step import Run, apply_plan

REPLAN_SHARE = 0.1     # re-plan at the end of the warm-up, and no earlier than this share of the first plan
MIN_TIMED_STEPS = 5    # fewer real steps before that point than this: the first plan stays
LATE_SHARES = (0.5, 0.8)   # the late checks, as shares of the plan's steps
LATE_TOLERANCE = 0.02      # a late check keeps the plan when the steps that fit are this close (share of those left)


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


def late_step(plan: dict[str, Any], timed_from: int, shares: tuple[float, ...] = LATE_SHARES) -> tuple[int, float] | None:
    """The next late check of `plan` and its share: the first of `shares` (those not checked yet) whose step is at
    least `MIN_TIMED_STEPS` steps after `timed_from` and before the last step (None: no check left)."""
    steps = int(plan["steps"])
    checks = ((math.ceil(share * steps), share) for share in shares)
    return next((check for check in checks if timed_from + MIN_TIMED_STEPS <= check[0] < steps), None)


def late_steps(at: int, steps: int, left_s: float, step_s: float, cap: int | None) -> int | None:
    """The steps of a run at step `at` of `steps` when `left_s` seconds are left for steps of `step_s` each (their
    periodic work included); None when that is within `LATE_TOLERANCE` of the plan. At least ``at + 1``."""
    fit = at + max(1, int(left_s / max(step_s, 1e-9)))
    if cap is not None:
        fit = min(fit, cap)
    return None if abs(fit - steps) <= LATE_TOLERANCE * (steps - at) else fit


class ReplanHook(TrainHook):
    """Times the steps of this attempt, plans again at the end of the warm-up (`replan_step`) and at the late
    checks (`late_step`); every rank takes rank 0's count."""

    def __init__(self, budget: BudgetClock, say: Callable[[str], None], on_plan: Callable[[], None]) -> None:
        self.budget, self.say, self.on_plan = budget, say, on_plan
        self.at: int | None = None        # the re-plan after the warm-up
        self.late_at: int | None = None   # the next late check
        self.shares: tuple[float, ...] = LATE_SHARES   # the late checks not made yet (each share once)
        self.first = 1                    # this attempt's first step: not timed (first allocations, data start)
        self.timed_from = (0, 0.0)        # (step, clock) the steps are timed from

    def start(self, run: Run, step: int) -> None:
        plan = run.cfg.time_budget_plan
        planned_here = self.budget.planned_here and step == 0   # a resumed run keeps the plan it has
        self.at = replan_step(plan) if planned_here and plan is not None else None
        self.first, self.late_at, self.shares = step + 1, None, LATE_SHARES

    def after_step(self, run: Run, end: StepEnd) -> None:
        if run.cfg.time_budget_plan is None or end.step not in (self.first, self.at, self.late_at):
            return
        sync_device(run)
        if end.step == self.at:
            self._replan(run)
        elif end.step == self.late_at:
            self._replan_late(run)
        self.timed_from = (end.step, clocks.clock())
        check = None if self.at is not None else late_step(run.cfg.time_budget_plan, end.step, self.shares)
        self.late_at = check[0] if check is not None else None
        if check is not None:   # this share and the earlier ones are done once it is checked
            self.shares = self.shares[self.shares.index(check[1]) + 1:]

    def _step_s(self, at: int) -> float:
        return (clocks.clock() - self.timed_from[1]) / max(1, at - self.timed_from[0])

    def _replan(self, run: Run) -> None:
        assert self.at is not None and run.cfg.time_budget_plan is not None
        plan, at, step_s = run.cfg.time_budget_plan, self.at, self._step_s(self.at)
        first = BudgetCosts(**plan["measured"])
        steps = replanned_steps(self.budget.budget_s, first, cadence_of(run), at, self.budget.spent_s(), step_s,
                                run.cfg.max_steps) if C.rank() == 0 else None
        steps, step_s = C.broadcast_object((steps, step_s) if C.rank() == 0 else None)
        why = (f"re-planned after step {at} from {at - self.timed_from[0]} trained steps of {step_s:.4g} s: {steps} "
               f"steps (first plan: {plan['steps']} steps of {first.step_s:.4g} s)")
        run.cfg.time_budget_plan = {**plan, "steps": steps, "why": f"{why}; first plan: {plan['why']}",
                                    "replanned": {"after_step": at, "first_steps": plan["steps"],
                                                  "step_s": round(step_s, 6)}}
        self.at = None
        self._apply(run, why)

    def _replan_late(self, run: Run) -> None:
        assert self.late_at is not None and run.cfg.time_budget_plan is not None
        plan, at, step_s = run.cfg.time_budget_plan, self.late_at, self._step_s(self.late_at)
        left_s = self.budget.budget_s * (1 - MARGIN_SHARE) - self.budget.reserve_s - self.budget.spent_s()
        steps = late_steps(at, int(plan["steps"]), left_s, step_s, run.cfg.max_steps) if C.rank() == 0 else None
        steps, step_s = C.broadcast_object((steps, step_s) if C.rank() == 0 else None)
        if steps is None:
            return
        stretch = (run.schedule.stretch or no_stretch(run.total_steps)).replanned(at, steps)
        why = (f"re-planned after step {at} from its last {at - self.timed_from[0]} steps, {step_s:.4g} s each with "
               f"their periodic work: {steps} steps (were {plan['steps']}); the schedules go on from where they are "
               f"and end at step {steps}")
        late = [*plan.get("late", []), {"after_step": at, "steps_before": plan["steps"], "step_s": round(step_s, 6)}]
        run.cfg.time_budget_plan = {**plan, "steps": steps, "stretch": stretch.as_record(), "late": late,
                                    "why": f"{why}; {plan['why']}"}
        self._apply(run, why)

    def _apply(self, run: Run, why: str) -> None:
        apply_plan(run)
        self.on_plan()
        self.say(f"time budget {run.cfg.time_budget}: {why}")
