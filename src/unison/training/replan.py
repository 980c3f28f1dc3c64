"""A ``--time-budget`` run checks its plan against the steps it trains, and plans again when they run far from it.

The first plan (`unison.training.budget`) comes from the few steps timed before the run (as few as two on a loaded
machine, where they can be off by a factor), so the run times its own steps and checks:

* **When** (`next_check`): as soon as `MIN_TIMED_STEPS` steps are timed, and every `MIN_TIMED_STEPS` steps while
  the warm-up is open (`open_warmup`: not planned again yet, its end not reached), so that a check can still plan
  it; then every `CHECK_SHARE` of the plan, up to `MIN_TIMED_STEPS` steps before its end. Each check times the
  steps since the one before (`window_step_s`: the periodic work planned among them taken out). Steps that do not
  show the run's pace are not timed, and the window starts again after them: the first step of each attempt (first
  allocations, data start) and the steps ``--profile-steps`` records (the profiler's overhead and the trace it
  writes).
* **Whether** (`far_from_plan`): the steps that fit what is left of the budget at that pace (`plan_steps` from
  the step reached: the first plan's rule) differ from the plan by more than `TOLERANCE` of the steps left (and by
  more than a step). Each check also sets the clock's reserve for the end from the pace it measured.
* **How** (`replanned`): a check inside the open warm-up (after step ``at < W``) plans the run again for the new
  count as if from step 0, once, its warm-up

      W' = max(at, min(budget_warmup(S'), W))

  the first plan's rule (`unison.training.step.budget_warmup`: at most a tenth of the run), never longer than
  the warm-up planned (the ramp would fall back below the rate trained) and never shorter than the steps already
  trained on it (the rate would leave the ramp for the cosine's decay before the peak), so that the learning rate
  never falls while it warms up. A check at or past the warm-up's end (``at >= W``, the peak reached), or after
  the one re-plan from step 0, lays the steps left onto what is left of the schedules
  (`unison.optim.schedule.Stretch`): the learning rate, the momentum and the teacher temperature go on from where
  they stand, without a jump, and end at the new last step.

Rank 0 decides and broadcasts; every rank applies the plan (`unison.training.step.apply_plan`). ``config.json``
and the checkpoints record each re-plan and why (``replanned``: the one from step 0; ``late``: those laid onto
the schedules, with where they stand under ``stretch``), and a resumed run keeps them and checks on. The clock
still ends a run whose steps turn slower after its last check (`unison.training.budget.BudgetClock`), and the
result line then says that the schedule did not finish.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from unison.distributed import collectives as C
from unison.optim.schedule import no_stretch
from unison.training import budget as clocks  # its `clock`, read at each call (a test skews it)
from unison.training.budget import BudgetClock, cadence_of, sync_device
from unison.training.budget_plan import costs_at, plan_steps, reserve_of
from unison.training.hooks import StepEnd, TrainHook
from unison.training.step import Run, apply_plan, budget_warmup

MIN_TIMED_STEPS = 5    # the fewest steps a check times
CHECK_SHARE = 0.1      # a check every this share of the plan's steps (after the first)
TOLERANCE = 0.02       # a check keeps the plan when the steps that fit are this close (share of the steps left)
MIN_STEP_SHARE = 0.5   # a window's pace is at least this share of its plain mean (`window_step_s`)


def open_warmup(run: Run) -> int:
    """The warm-up a check of `run` may still plan again as from step 0: the plan's own until its first re-plan,
    then none. One start from step 0 is enough: it comes from the first five steps timed, and the later checks,
    which time a tenth of the plan, lay what they find onto the schedules instead of moving the ramp again."""
    plan = run.cfg.time_budget_plan or {}
    return 0 if "replanned" in plan or "stretch" in plan else run.schedule.warmup_steps


def next_check(steps: int, warmup: int, timed_from: int) -> int | None:
    """The step of the next check of a `steps`-step plan whose open warm-up (`open_warmup`) is `warmup` steps, when
    the steps are timed from step `timed_from`: `MIN_TIMED_STEPS` steps on inside the warm-up (a check there can
    still plan it again), else `CHECK_SHARE` of the plan on (at least `MIN_TIMED_STEPS`). None: no check left, none
    in the last `MIN_TIMED_STEPS` steps (a new count would change no more than those; the clock ends the run on
    time)."""
    if timed_from < warmup:
        at = timed_from + MIN_TIMED_STEPS
    else:
        at = timed_from + max(MIN_TIMED_STEPS, math.ceil(CHECK_SHARE * steps))
    return at if at <= steps - MIN_TIMED_STEPS else None


def window_step_s(elapsed_s: float, steps: int, planned_work_s: float) -> float:
    """The pace of `steps` steps that took `elapsed_s` with the periodic work planned among them (kNN, checkpoint
    copies, signals: `planned_work_s`) taken out; at least `MIN_STEP_SHARE` of the plain mean, so that work which
    took less than measured cannot make the steps look free."""
    return max(elapsed_s - planned_work_s, MIN_STEP_SHARE * elapsed_s) / max(1, steps)


def far_from_plan(at: int, steps: int, fit: int) -> bool:
    """Whether a plan of `steps` steps, checked after step `at`, is to be planned again for the `fit` that fit."""
    return abs(fit - steps) > max(1.0, TOLERANCE * (steps - at))


def replanned(plan: dict[str, Any], run: Run, at: int, steps: int, step_s: float, timed: int) -> tuple[dict[str, Any], str]:
    """The plan of `run` after a check at step `at` found that `steps` steps of `step_s` fit (timed over `timed`
    steps), and the sentence that says so, naming the warm-up the run trains (the module docstring's **How**)."""
    cfg, was, warmup = run.cfg, int(plan["steps"]), int(plan["warmup_steps"])
    if at < open_warmup(run):   # inside the warm-up, not planned again yet: as from step 0
        warmup = max(at, min(budget_warmup(steps, cfg.warmup_epochs, run.steps_per_epoch), warmup))
        why = (f"re-planned after step {at} from {timed} trained steps of {step_s:.4g} s: {steps} steps, "
               f"{warmup} of them warm-up (first plan: {was} steps, {plan['warmup_steps']} warm-up, of "
               f"{plan['measured']['step_s']:.4g} s)")
        record = {"after_step": at, "first_steps": was, "step_s": round(step_s, 6)}
        return {**plan, "steps": steps, "warmup_steps": warmup, "why": f"{why}; first plan: {plan['why']}",
                "replanned": record}, why
    stretch = (run.schedule.stretch or no_stretch(run.total_steps)).replanned(at, steps)
    why = (f"re-planned after step {at} from its last {timed} steps, {step_s:.4g} s each: {steps} steps (were "
           f"{was}); the schedules go on from where they are and end at step {steps}")
    knot_at, position = stretch.knots[-1]
    if position < run.schedule.warmup_steps:   # still on the ramp: it is laid onto the steps left too
        ramp_end = knot_at + (run.schedule.warmup_steps - position) * (steps - knot_at) / (stretch.length - position)
        why += f", its warm-up now ending at step {math.ceil(ramp_end)}"
    late = [*plan.get("late", []), {"after_step": at, "steps_before": was, "step_s": round(step_s, 6)}]
    return {**plan, "steps": steps, "stretch": stretch.as_record(), "late": late, "why": f"{why}; {plan['why']}"}, why


class ReplanHook(TrainHook):
    """Times the steps of this attempt and checks the plan (`next_check`, `far_from_plan`); every rank takes rank
    0's decision. `untimed(step)`: whether step `step` (1-based, as `StepEnd.step`) is not to be timed."""

    def __init__(self, budget: BudgetClock, say: Callable[[str], None], on_plan: Callable[[], None],
                 untimed: Callable[[int], bool] = lambda step: False) -> None:
        self.budget, self.say, self.on_plan, self.untimed = budget, say, on_plan, untimed
        self.first = 1                    # this attempt's first step: not timed
        self.at: int | None = None        # the next check
        self.timed_from = (0, 0.0)        # (step, clock) the steps are timed from

    def start(self, run: Run, step: int) -> None:
        self.first, self.at = step + 1, None

    def after_step(self, run: Run, end: StepEnd) -> None:
        if run.cfg.time_budget_plan is None or "measured" not in run.cfg.time_budget_plan:
            return   # a plan written by hand: nothing measured to plan again from
        if end.step == self.first or self.untimed(end.step):
            self._time_from(run, end.step)
        elif end.step == self.at:
            sync_device(run)
            self._check(run, end.step)
            self._time_from(run, end.step)

    def _time_from(self, run: Run, step: int) -> None:
        sync_device(run)
        self.timed_from = (step, clocks.clock())
        self.at = next_check(run.total_steps, open_warmup(run), step)

    def _check(self, run: Run, at: int) -> None:
        plan, budget = run.cfg.time_budget_plan, self.budget
        assert plan is not None
        timed = at - self.timed_from[0]
        decision = None
        if C.rank() == 0:
            costs, _ = costs_at(plan, C.world_size())
            cadence = cadence_of(run)
            step_s = window_step_s(clocks.clock() - self.timed_from[1], timed,
                                   cadence.work_s(costs, run.total_steps, self.timed_from[0], at))
            now = replace(costs, spent_s=budget.spent_s(), step_s=step_s)
            fit = max(at + 1, plan_steps(budget.budget_s, now, cadence, run.cfg.max_steps, at=at))
            budget.reserve_s = reserve_of(now, cadence)   # the stop delay at the pace measured
            decision = (fit if far_from_plan(at, run.total_steps, fit) else None, step_s)
        steps, step_s = C.broadcast_object(decision)
        if steps is None:
            return
        run.cfg.time_budget_plan, why = replanned(plan, run, at, steps, step_s, timed)
        apply_plan(run)
        self.on_plan()
        self.say(f"time budget {run.cfg.time_budget}: {why}")
