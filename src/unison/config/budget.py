"""``--time-budget DURATION``: how a duration is written, and what a budgeted run records of its plan.

A duration is a number with a unit, or several (``90s``, ``10m``, ``2h``, ``1h30m``, ``1.5h``); a bare number is
seconds. The plan (`TrainConfig.time_budget_plan`) is written by the run itself once it has measured its step
(`unison.training.budget`): the steps that fit, the warm-up, and the measured costs they were planned from.
It travels in ``config.json`` and in every checkpoint, so a resumed run keeps it instead of measuring again.
"""

from __future__ import annotations

import math
import re
from typing import Any

from unison.errors import ConfigError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd])")
MIN_BUDGET_S = 1.0
MAX_BUDGET_S = 366 * 86400.0   # a year: past it a duration is a typo
PLAN_KEYS = ("budget_s", "steps", "warmup_steps")


def duration_with_units(text: str) -> float | None:
    """Seconds of a duration written with units (``90s``, ``10m``, ``1h30m``, ``1.5h``), None if it is not one:
    the one grammar of durations (``--time-budget``, ``--checkpoint-every 10m``), each option its own range."""
    s = str(text).strip().lower()
    parts = _PART.findall(s) if 0 < len(s) <= 32 and s.isascii() else []
    if not parts or _PART.sub("", s).strip():
        return None
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_duration(text: str, flag: str = "--time-budget") -> float:
    """Seconds of a duration such as ``10m``, ``2h``, ``90s``, ``1h30m`` or ``600``; `ConfigError` if malformed."""
    s = str(text).strip().lower()
    if len(s) > 32 or not s:
        raise ConfigError(f"{flag} {text!r:.40} is not a duration; write e.g. 90s, 10m, 2h or 1h30m")
    try:
        seconds = float(s) if re.fullmatch(r"\d+(\.\d*)?|\.\d+", s) else None
    except ValueError:
        seconds = None
    if seconds is None:
        seconds = duration_with_units(s)
        if seconds is None:
            raise ConfigError(f"{flag} {text!r:.40} is not a duration; write e.g. 90s, 10m, 2h or 1h30m")
    if not math.isfinite(seconds) or not MIN_BUDGET_S <= seconds <= MAX_BUDGET_S:
        raise ConfigError(f"{flag} {text!r:.40} is {seconds:g} s; give from {MIN_BUDGET_S:g} s to a year")
    return seconds


def check_plan(plan: Any, budget: str | None) -> None:
    """A recorded plan must be one a budgeted run wrote, for this budget: a resumed run keeps it, and a different
    ``--time-budget`` would silently train another schedule than the one planned."""
    if plan is None:
        return
    if budget is None:
        raise ConfigError("time_budget_plan is set but --time-budget is not; a plan is written by a budgeted run "
                          "(drop time_budget_plan from the config to plan by --epochs/--max-steps)")
    if not isinstance(plan, dict) or any(k not in plan for k in PLAN_KEYS):
        raise ConfigError(f"time_budget_plan must be the mapping a budgeted run records (keys {', '.join(PLAN_KEYS)});"
                          " drop it to measure and plan again")
    steps, warmup = plan["steps"], plan["warmup_steps"]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, warmup))
    if not (ints and steps >= 1 and 0 <= warmup and (warmup < steps or warmup == 0)):
        raise ConfigError(f"time_budget_plan has steps={steps!r}, warmup_steps={warmup!r}; a plan has at least one "
                          "step and a warm-up shorter than the run (drop it to measure and plan again)")
    if "stretch" in plan and not _is_stretch(plan["stretch"], steps):
        raise ConfigError("time_budget_plan's stretch must be the record a late re-plan writes ({'knots': [[step, "
                          "position], ...] in step order, 'length': steps}); drop the plan to measure and plan again")
    if abs(float(plan["budget_s"]) - parse_duration(budget)) > 1e-6:
        raise ConfigError(f"this run was planned for a {plan['budget_s']:g} s budget ({steps} steps) and resumes with "
                          f"--time-budget {budget}; resume with its budget (a resumed run keeps its plan), or start "
                          "a new run directory")


def _is_stretch(record: Any, steps: int) -> bool:
    """Whether `record` is a late re-plan's stretch for `steps` steps (`unison.optim.schedule.Stretch`)."""
    if not isinstance(record, dict) or not isinstance(record.get("knots"), list):
        return False
    length, knots = record.get("length"), record["knots"]

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    pairs = all(isinstance(k, list) and len(k) == 2 and isinstance(k[0], int) and number(k[1]) for k in knots)
    if not (pairs and isinstance(length, int) and not isinstance(length, bool) and length >= 1):
        return False
    at = [k[0] for k in knots] + [steps]
    return all(a < b for a, b in zip(at, at[1:])) and all(0 <= k[1] < length for k in knots)
