"""TESTING ONLY: a hook for the ``--time-budget`` tests (registered like `fault_injection`, by `register`).

``UNISON_TEST_BUDGET="skew=50,plan=4,replan=3,late=4"``: on rank 1, the budget's clock runs `skew` times fast
(its own measurement would plan far fewer steps than rank 0's). On every rank the budget's clock then sees each
step of the loop `plan` times as long as it really took (slower than the measurement before the run: the re-plan
after the warm-up sees it, `unison.training.replan`), `replan` times longer again after that re-plan (a late
re-plan sees it) and `late` times longer again after the last late check, so only the clock can end the run on
time. The slowdowns are factors of the real step time, added to the clock rather than slept: a loaded machine that
slows every step by up to 2x cannot undo them, and a slow step costs no wall time. Every rank writes what it trained
to ``<out>/budget-rank<R>.json``: the planned steps, the method's schedule length, the steps taken and the longest
step as the clock saw it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from unison.config import TrainConfig
from unison.training import budget
from unison.training.hooks import HOOKS_ENV, StepEnd, TrainHook
from unison.training.replan import LATE_SHARES
from unison.training.step import Run

ENV = "UNISON_TEST_BUDGET"


class SlowClock:
    """The budget's clock: real time (`skew` times fast) plus the slowdowns added so far."""

    def __init__(self, skew: float) -> None:
        self.skew, self.started, self.added = skew, time.perf_counter(), 0.0

    def __call__(self) -> float:
        return self.started + (time.perf_counter() - self.started) * self.skew + self.added


class BudgetProbe(TrainHook):
    def __init__(self, rank: int, out: str, clock: SlowClock, plan: float, replan: float, late: float) -> None:
        self.rank, self.out, self.clock, self.steps = rank, Path(out), clock, 0
        self.factors = (plan, replan, late)
        self.run: Run | None = None
        self.step_started, self.longest_s = 0.0, 0.0

    def start(self, run: Run, step: int) -> None:
        self.run, self.steps, self.step_started = run, step, time.perf_counter()

    def after_step(self, run: Run, end: StepEnd) -> None:
        self.steps = end.step
        plan = run.cfg.time_budget_plan or {}
        checked = "late" in plan and end.step > math.ceil(LATE_SHARES[-1] * plan["steps"])
        plan_f, replan_f, late_f = self.factors
        factor = plan_f * (replan_f if "replanned" in plan else 1.0) * (late_f if checked else 1.0)
        now = time.perf_counter()
        real_s, self.step_started = now - self.step_started, now
        self.clock.added += (factor - 1.0) * real_s * self.clock.skew
        self.longest_s = max(self.longest_s, factor * real_s * self.clock.skew)

    def close(self) -> None:
        assert self.run is not None
        record = {"rank": self.rank, "total_steps": self.run.total_steps, "steps_total": self.run.method.steps_total,
                  "plan_steps": self.run.cfg.time_budget_plan["steps"], "steps": self.steps,
                  "longest_step_s": self.longest_s}
        (self.out / f"budget-rank{self.rank}.json").write_text(json.dumps(record))


def train_hooks(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    spec = dict(kv.split("=") for kv in os.environ.get(ENV, "").split(",") if "=" in kv)
    clock = SlowClock(float(spec.get("skew", 1)) if rank == 1 else 1.0)
    budget.clock = clock
    return [BudgetProbe(rank, cfg.out, clock, *(float(spec.get(k, 1)) for k in ("plan", "replan", "late")))]


def register(monkeypatch: Any, spec: str) -> None:
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(HOOKS_ENV, __name__)
    monkeypatch.setenv(ENV, spec)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here if not path else os.pathsep.join([here, path]))
