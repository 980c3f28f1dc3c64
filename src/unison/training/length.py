"""How many steps a run has and how many of them warm up: the one rule every schedule is planned from.

`unison.training.step.build_run` plans the learning rate and the method's schedules with it, a resumed run re-plans
with it for a new ``--epochs``/``--max-steps``, and a ``--time-budget`` run (`unison.training.budget`) with the
plan it measured (`unison.training.step.apply_plan`).
"""

from __future__ import annotations

from unison.config import TrainConfig
from unison.optim.schedule import Schedule, Stretch

PROVISIONAL_BUDGET_STEPS = 10**9   # a budgeted run before its plan: far more steps than any budget holds


def plan_length(cfg: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """(total steps, warm-up steps): the one rule every schedule (lr, the method's momentum and temperature) is
    planned from. `--epochs` (capped by `--max-steps`), or a `--time-budget` run's plan (`unison.training.budget`);
    unplanned yet, a provisional length for its measurement steps (then `apply_plan` puts the plan in place)."""
    plan = cfg.time_budget_plan
    if plan is not None:
        return int(plan["steps"]), int(plan["warmup_steps"])
    if cfg.time_budget is not None:   # provisional: only the measurement steps run on it
        total_steps = cfg.max_steps or PROVISIONAL_BUDGET_STEPS
    else:
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)
    warmup_steps = min(total_steps - 1, int(cfg.warmup_epochs * steps_per_epoch)) if total_steps > 1 else 0
    return total_steps, warmup_steps


def plan_stretch(cfg: TrainConfig) -> Stretch | None:
    """Where the steps of a budgeted run re-planned late fall on its schedules (`unison.training.replan`); None
    for every other run (its steps are the schedules' own)."""
    plan = cfg.time_budget_plan
    if plan is None or "stretch" not in plan:
        return None
    return Stretch.of_record(plan["stretch"], int(plan["steps"]))


def planned_schedule(cfg: TrainConfig, steps_per_epoch: int, peak_lr: float) -> Schedule:
    """The learning-rate schedule `cfg` plans (`plan_length`, `plan_stretch`, ``--final-lr-ratio``): the one rule
    `unison.training.step.build_run` and `apply_plan` use."""
    total_steps, warmup_steps = plan_length(cfg, steps_per_epoch)
    return Schedule(peak_lr, warmup_steps, total_steps, plan_stretch(cfg), cfg.final_lr_ratio)
