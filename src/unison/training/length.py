"""How many steps a run has and how many of them warm up: the one rule every schedule is planned from.

`unison.training.step.build_run` plans the learning rate and the method's schedules with it, a resumed run re-plans
with it for a new ``--epochs``/``--max-steps``, and a ``--time-budget`` run (`unison.training.budget`) with the
plan it measured (`unison.training.step.apply_plan`).
"""

from __future__ import annotations

from unison.config import TrainConfig
from unison.optim.schedule import Schedule, Stretch

PROVISIONAL_BUDGET_STEPS = 10**9   # a budgeted run before its plan: far more steps than any budget holds
WARMUP_SHARE_MAX = 0.1       # the warm-up of a budgeted run is at most this share of its steps


def budget_warmup(steps: int, warmup_epochs: float, steps_per_epoch: int) -> int:
    """The warm-up of a budgeted run of `steps` steps: ``--warmup-epochs``, at most `WARMUP_SHARE_MAX` of its
    steps; the one rule of the first plan, of a re-plan that starts its schedules again (held there between the
    steps already trained on the ramp and the warm-up planned: `unison.training.replan`) and of a ``--max-steps``
    cap given on resume."""
    if steps <= 1:
        return 0
    return min(int(warmup_epochs * steps_per_epoch), int(WARMUP_SHARE_MAX * steps), steps - 1)


def plan_length(cfg: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """(total steps, warm-up steps): the one rule every schedule (lr, the method's momentum and temperature) is
    planned from. `--epochs` (capped by `--max-steps`), or a `--time-budget` run's plan (`unison.training.budget`),
    which ``--max-steps`` caps too (given smaller on resume: a run of that length from the start, its warm-up by
    `budget_warmup`, as a resumed ``--epochs`` run given another length is planned); unplanned
    yet, a provisional length for its measurement steps (then `apply_plan` puts the plan in place)."""
    plan = cfg.time_budget_plan
    if plan is not None:
        steps = planned_steps(cfg)
        if steps < int(plan["steps"]):   # --max-steps below the plan: the first plan's rule for the warm-up
            return steps, budget_warmup(steps, cfg.warmup_epochs, steps_per_epoch)
        return steps, int(plan["warmup_steps"])
    if cfg.time_budget is not None:   # provisional: only the measurement steps run on it
        total_steps = cfg.max_steps or PROVISIONAL_BUDGET_STEPS
    else:
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)
    warmup_steps = min(total_steps - 1, int(cfg.warmup_epochs * steps_per_epoch)) if total_steps > 1 else 0
    return total_steps, warmup_steps


def planned_steps(cfg: TrainConfig) -> int:
    """The steps of a budgeted run's plan, capped by ``--max-steps`` (given again on resume: it caps them too)."""
    assert cfg.time_budget_plan is not None
    return min(int(cfg.time_budget_plan["steps"]), cfg.max_steps or PROVISIONAL_BUDGET_STEPS)


def plan_stretch(cfg: TrainConfig) -> Stretch | None:
    """Where the steps of a budgeted run re-planned late fall on its schedules (`unison.training.replan`); None
    for every other run (its steps are the schedules' own)."""
    plan = cfg.time_budget_plan
    if plan is None or "stretch" not in plan or planned_steps(cfg) < int(plan["steps"]):
        return None   # capped by --max-steps on resume: planned as a run of that length from the start
    return Stretch.of_record(plan["stretch"], int(plan["steps"]))


def planned_schedule(cfg: TrainConfig, steps_per_epoch: int, peak_lr: float) -> Schedule:
    """The learning-rate schedule `cfg` plans (`plan_length`, `plan_stretch`, ``--final-lr-ratio``): the one rule
    `unison.training.step.build_run` and `apply_plan` use."""
    total_steps, warmup_steps = plan_length(cfg, steps_per_epoch)
    return Schedule(peak_lr, warmup_steps, total_steps, plan_stretch(cfg), cfg.final_lr_ratio)
