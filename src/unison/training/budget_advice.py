"""What a ``--time-budget`` run says when its budget is mostly start-up: the smallest sensible budget on this
machine, from what the run measured (`unison.training.budget`'s costs), never a fixed figure.

A run spends some time whatever its length: the start (data, model, the random-initialisation kNN, the step
measurement) and the end (final kNN, signals, checkpoint). On a CPU these are slow enough that a short budget
trains for a small share of itself. `sensible_budget_s` is the smallest budget whose steps get
`SENSIBLE_STEP_SHARE` of it; `too_short` is the clause of the refusal of a budget with no room for a step,
`short_budget` the warning for one whose steps get less than that share.
"""

from __future__ import annotations

import math

__all__ = ["SENSIBLE_STEP_SHARE", "sensible_budget_s", "short_budget", "too_short"]

SENSIBLE_STEP_SHARE = 0.5   # below this share of the budget for its steps, a run is mostly start-up and end


def sensible_budget_s(fixed_s: float, margin_share: float) -> float:
    """The smallest budget whose steps get `SENSIBLE_STEP_SHARE` of it, when `fixed_s` goes to the start, the end
    and the stop delay whatever the length, and `margin_share` of the budget is kept free."""
    return fixed_s / max(1e-9, 1 - margin_share - SENSIBLE_STEP_SHARE)


def too_short(start_s: float, end_s: float, step_s: float, margin_share: float) -> str:
    """The clause of the refusal of a budget with no room for a step: what the start and the end take on this
    machine, and the budget to give."""
    smallest = duration(sensible_budget_s(start_s + end_s + step_s, margin_share))
    return (f"on this machine the start and the end of a run take {start_s + end_s:.1f} s whatever its length: give "
            f"at least --time-budget {smallest} (half of it for steps)")


def short_budget(budget_s: float, start_s: float, end_s: float, step_s: float, steps: int,
                 margin_share: float) -> str | None:
    """The warning for a budget whose `steps` get less than `SENSIBLE_STEP_SHARE` of it, with the smallest
    sensible one; None above it."""
    training = steps * step_s
    if steps < 1 or training >= SENSIBLE_STEP_SHARE * budget_s:
        return None
    smallest = duration(sensible_budget_s(start_s + end_s + step_s, margin_share))
    return (f"only {training:.1f} s of the {budget_s:g} s ({training / budget_s:.0%}) go to the {steps} steps: the "
            f"start took {start_s:.1f} s (data, model, baseline kNN, measurement) and the end takes {end_s:.1f} s "
            f"(final kNN, signals, checkpoint) whatever the budget; on this machine --time-budget {smallest} or more "
            "gives the steps half of it")


def duration(seconds: float) -> str:
    """`seconds` rounded up to a duration ``--time-budget`` takes: ``95s`` below two minutes, ``3m`` below two
    hours, ``2h``."""
    seconds = math.ceil(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 60)}m"
    return f"{math.ceil(seconds / 3600)}h"
