"""TESTING ONLY: a hook for the ``--time-budget`` tests (registered like `fault_injection`, by `register`).

``UNISON_TEST_BUDGET="skew=100,slow=0.1,sleep=0.5,late=1"``: on rank 1, the budget's clock runs `skew` times fast
(its own measurement would plan far fewer steps than rank 0's); on every rank each step after the plan sleeps `slow`
seconds more than measured (the re-plan after the warm-up sees it: `unison.training.replan`), each step after that
re-plan `sleep` seconds more (a late re-plan sees it), and each step after the last late check `late` seconds more,
so only the clock can end the run on time. Every rank writes what it trained to
``<out>/budget-rank<R>.json``: the planned steps, the method's schedule length and the steps taken.
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


class BudgetProbe(TrainHook):
    def __init__(self, rank: int, out: str, slow: float, sleep: float, late: float) -> None:
        self.rank, self.out, self.slow, self.sleep, self.late, self.steps = rank, Path(out), slow, sleep, late, 0
        self.run: Run | None = None

    def start(self, run: Run, step: int) -> None:
        self.run, self.steps = run, step

    def after_step(self, run: Run, end: StepEnd) -> None:
        self.steps = end.step
        plan = run.cfg.time_budget_plan or {}
        checked = "late" in plan and end.step > math.ceil(LATE_SHARES[-1] * plan["steps"])
        time.sleep(self.slow + (self.sleep if "replanned" in plan else 0.0) + (self.late if checked else 0.0))

    def close(self) -> None:
        assert self.run is not None
        record = {"rank": self.rank, "total_steps": self.run.total_steps, "steps_total": self.run.method.steps_total,
                  "plan_steps": self.run.cfg.time_budget_plan["steps"], "steps": self.steps}
        (self.out / f"budget-rank{self.rank}.json").write_text(json.dumps(record))


def train_hooks(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    spec = dict(kv.split("=") for kv in os.environ.get(ENV, "").split(",") if "=" in kv)
    skew = float(spec.get("skew", 1))
    if rank == 1 and skew != 1:
        real, t0 = time.perf_counter, time.perf_counter()
        budget.clock = lambda: t0 + (real() - t0) * skew
    return [BudgetProbe(rank, cfg.out, *(float(spec.get(k, 0)) for k in ("slow", "sleep", "late")))]


def register(monkeypatch: Any, spec: str) -> None:
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(HOOKS_ENV, __name__)
    monkeypatch.setenv(ENV, spec)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here if not path else os.pathsep.join([here, path]))
