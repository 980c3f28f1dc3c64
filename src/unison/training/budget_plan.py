"""The planner of a ``--time-budget`` run: pure functions of the measured costs (`unison.training.budget` measures
them, `unison.training.replan` plans again from the run's own steps).

`plan_steps`: the largest step count N for which the time spent, the steps to N and their periodic work
(`Cadence`: epoch checkpoints, ``--eval-every`` kNN, the label-free signals), the reserve for the end (`reserve_of`:
the final kNN, signals and checkpoint, one step of stop delay) and a margin fit the budget. `costs_at`: the costs
of a plan for the world size a resumed run has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from unison.training.signals import AUTO_EVALUATIONS, AUTO_MIN_EVERY

MARGIN_SHARE = 0.02          # kept free of the plan: clocks, logging, the variation of the step time


@dataclass(frozen=True)
class BudgetCosts:
    """What the plan is made from, in seconds (all measured on this run, rank 0's values)."""

    spent_s: float              # the budget spent when the plan is made (start-up, data, measurement)
    step_s: float               # one steady optimiser step, with the online probe's share
    knn_s: float                # one kNN evaluation (0: the run has none)
    signals_s: float            # one measurement of the label-free signals (0: none)
    checkpoint_copy_s: float    # what the step loop waits for at a periodic (background) checkpoint
    checkpoint_s: float         # the final checkpoint, written before the run returns


@dataclass(frozen=True)
class Cadence:
    """How often the periodic work of the run happens (from its configuration)."""

    steps_per_epoch: int
    eval_every: int = 0          # kNN every N epochs (0: only at the end)
    checkpoint_every: int = 0    # steps (0: every epoch, unless checkpoint_every_s)
    signals_every: int = 0       # steps (0: automatic, `unison.training.signals`)
    signals: bool = True
    checkpoint_every_s: float = 0.0   # --checkpoint-every 10m: one save per that much training time

    def periodic_s(self, steps: int, costs: BudgetCosts) -> float:
        """The time the periodic work of a `steps`-step run takes, the final work excluded."""
        return self.work_s(costs, steps)

    def work_s(self, costs: BudgetCosts, steps: int, start: int = 0, end: int | None = None) -> float:
        """The periodic work of a `steps`-step run after its step `start` up to its step `end` (default: all of
        it), the final work (after the last step) excluded; from step 0, the start's signals included."""
        last = min(steps if end is None else end, steps - 1)   # the last step's work is the final work

        def after(every: int) -> int:   # the multiples of `every` past `start`, up to `last`
            return max(0, last // every - start // every) if every else 0

        if self.checkpoint_every_s:
            saves = int(max(0, last + 1 - start) * costs.step_s / self.checkpoint_every_s)
        else:
            saves = after(self.checkpoint_every or self.steps_per_epoch)
        evals = after(self.eval_every * self.steps_per_epoch)
        every = self.signals_every or max(AUTO_MIN_EVERY, math.ceil(steps / AUTO_EVALUATIONS))
        signals = (after(every) + (start == 0 < steps)) if self.signals else 0   # the start's and the periodic ones
        return saves * costs.checkpoint_copy_s + evals * costs.knn_s + signals * costs.signals_s


def final_s(costs: BudgetCosts, cadence: Cadence) -> float:
    """The end of the run after its last step: kNN, signals, the checkpoint written in full."""
    return costs.knn_s + (costs.signals_s if cadence.signals else 0.0) + costs.checkpoint_s


def reserve_of(costs: BudgetCosts, cadence: Cadence) -> float:
    """What the clock keeps for the end of the run (`BudgetClock.reserve_s`): the final work and one step of stop
    delay (the ranks agree to stop a step after rank 0's clock says so)."""
    return final_s(costs, cadence) + costs.step_s


def plan_steps(budget_s: float, costs: BudgetCosts, cadence: Cadence, cap: int | None = None, at: int = 0) -> int:
    """The most steps N for which the budget holds the time spent (``costs.spent_s``, at step `at`), the steps
    from `at` to N and their periodic work, the reserve for the end (`reserve_of`) and a margin of
    `MARGIN_SHARE`; `at` when not even one more fits. `cap`: ``--max-steps``. The rule of the first plan (`at`
    0) and of every re-plan (`unison.training.replan`)."""
    room = budget_s * (1 - MARGIN_SHARE) - costs.spent_s - reserve_of(costs, cadence)

    def fits(n: int) -> bool:
        return (n - at) * costs.step_s + cadence.work_s(costs, n, at) <= room

    hi = at + int(max(0.0, room) / max(costs.step_s, 1e-9)) + 1
    if cap is not None:
        hi = max(at, min(hi, cap))
    lo = at
    while lo < hi:   # the time grows with N: the last N that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def costs_at(plan: dict[str, Any], world: int) -> tuple[BudgetCosts, str]:
    """The plan's measured costs for a run on `world` workers, and what was done to them ("" when nothing): a
    run resumed at another world size scales the work its workers share (the step at the same global batch, the
    kNN's and the signals' embedding) by the ratio of the world sizes; the checkpoint, which rank 0 writes
    alone, stays as measured."""
    costs = BudgetCosts(**plan["measured"])
    measured_at = int(plan.get("world_size", world))
    if measured_at == world:
        return costs, ""
    share = measured_at / world
    scaled = replace(costs, step_s=costs.step_s * share, knn_s=costs.knn_s * share,
                     signals_s=costs.signals_s * share)
    return scaled, f"measured at {measured_at} worker(s), scaled to {world}"
