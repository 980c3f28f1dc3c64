"""TESTING ONLY: a hook for the ``--time-budget`` tests (registered like `fault_injection`, by `register`).

``UNISON_TEST_BUDGET="skew=50,plan=4,replan=3,late=4"``: on rank 1, the budget's clock runs `skew` times fast
(its own measurement would plan far fewer steps than rank 0's). On rank 0, which decides, the budget's clock counts
each step of the loop as `plan` times the step measured before the run, whatever it really took (slower than
measured: the first check, five steps timed inside the warm-up, sees it and re-plans from step 0,
`unison.training.replan`), `replan` times that after that re-plan (the next check sees it and lays the steps left
onto the schedules) and `late` times that after the last check (`next_check` of `open_warmup`, followed here as
the run follows it), so only the clock can end the run on time. The step times the clock sees are then set by
the test, not by the machine's load, which once made a re-plan plan more steps, not fewer, and another run out of
budget before its late check; a slow step costs no wall time.
Every rank writes what it trained to ``<out>/budget-rank<R>.json``: the planned steps, the method's schedule
length, the steps taken and the longest step as its clock counted it.

``term=K``: rank 1 sends itself SIGTERM in the K-th step of the budget's measurement (before the step loop); every
rank writes the measurement steps it took to ``<out>/measured-rank<R>.json`` as it takes them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from unison.config import TrainConfig
from unison.training import budget
from unison.training.hooks import HOOKS_ENV, StepEnd, TrainHook
from unison.training.replan import next_check, open_warmup
from unison.training.step import Run

ENV = "UNISON_TEST_BUDGET"


class SlowClock:
    """The budget's clock: real time (`skew` times fast) plus what `BudgetProbe` added to the steps."""

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
        self.first, self.check, self.checked = 1, None, False   # the run's checks of its plan, followed

    def start(self, run: Run, step: int) -> None:
        self.run, self.steps, self.step_started = run, step, self.clock()
        self.first, self.check, self.checked = step + 1, None, False

    def _follow_checks(self, run: Run, step: int) -> None:
        """Where the run checks its plan (the loop's hook ran first): after its last check, `checked` is True."""
        if step == self.first or step == self.check:
            self.check = next_check(run.total_steps, open_warmup(run), step)
            self.checked = self.check is None and step != self.first

    def after_step(self, run: Run, end: StepEnd) -> None:
        self.steps = end.step
        self._follow_checks(run, end.step)
        plan = run.cfg.time_budget_plan or {}
        if self.rank == 0 and "measured" in plan:   # the step as long as the test says (never shorter than it was)
            checked = self.checked and "late" in plan
            plan_f, replan_f, late_f = self.factors
            factor = plan_f * (replan_f if "replanned" in plan else 1.0) * (late_f if checked else 1.0)
            self.clock.added += max(0.0, factor * plan["measured"]["step_s"] - (self.clock() - self.step_started))
        now = self.clock()
        self.longest_s, self.step_started = max(self.longest_s, now - self.step_started), now

    def close(self) -> None:
        assert self.run is not None
        record = {"rank": self.rank, "total_steps": self.run.total_steps, "steps_total": self.run.method.steps_total,
                  "plan_steps": self.run.cfg.time_budget_plan["steps"], "steps": self.steps,
                  "longest_step_s": self.longest_s}
        (self.out / f"budget-rank{self.rank}.json").write_text(json.dumps(record))


def _stop_in_measurement(out: str, rank: int, at: int) -> None:
    """Rank 1 signals itself in the `at`-th measurement step; every rank records the steps it measured."""
    real_step, taken = budget.optimizer_step, []
    record = Path(out) / f"measured-rank{rank}.json"

    def measured_step(run: Run, step: int) -> Any:
        taken.append(step)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"steps": len(taken)}))
        if rank == 1 and len(taken) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(run, step)

    budget.optimizer_step = measured_step


def train_hooks(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    spec = dict(kv.split("=") for kv in os.environ.get(ENV, "").split(",") if "=" in kv)
    clock = SlowClock(float(spec.get("skew", 1)) if rank == 1 else 1.0)
    budget.clock = clock
    if "term" in spec:
        _stop_in_measurement(cfg.out, rank, int(spec["term"]))
    return [BudgetProbe(rank, cfg.out, clock, *(float(spec.get(k, 1)) for k in ("plan", "replan", "late")))]


def register(monkeypatch: Any, spec: str) -> None:
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(HOOKS_ENV, __name__)
    monkeypatch.setenv(ENV, spec)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here if not path else os.pathsep.join([here, path]))
