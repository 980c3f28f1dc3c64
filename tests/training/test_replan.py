"""A budgeted run checks its plan against the steps it trains (as soon as a few steps are timed, every few steps while
its warm-up is open, then every tenth of the plan) and plans again when they run far from it: inside the warm-up,
once, as from step 0 (the warm-up by the first plan's rule, never shorter than the steps trained on it), from the
warm-up's end on by laying the steps left onto its schedules (no jump: the learning rate never falls from the ramp
or the peak). Steps ``--profile-steps`` records are not timed. The budget's clock is faked: the steps take what
each test says."""

import math
from dataclasses import asdict

import pytest
import torch

from unison.config import DistributedConfig, TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.errors import ConfigError
from unison.training import budget
from unison.training.budget import BudgetClock, BudgetCosts, Cadence, plan_steps, reserve_of
from unison.training.hooks import StepEnd
from unison.training.replan import ReplanHook, far_from_plan, next_check, open_warmup, replanned, window_step_s
from unison.training.step import apply_plan, budget_warmup, build_run

FIRST = BudgetCosts(spent_s=10.0, step_s=1.0, knn_s=0.0, signals_s=0.0, checkpoint_copy_s=0.0, checkpoint_s=0.0)
NO_WORK = Cadence(steps_per_epoch=2, signals=False)   # the synthetic runs below: 8 images, batch 4, nothing periodic


@pytest.fixture
def local_group():
    yield
    shutdown_distributed(None)


def _plan(steps: int, warmup: int, budget_s: float = 600.0) -> dict:
    return {"budget_s": budget_s, "steps": steps, "warmup_steps": warmup, "reserve_s": 1.0, "why": "measured",
            "measured": asdict(FIRST)}


def _run(tmp_path, plan: dict, method: str = "byol", warmup_epochs: float = 5.0):
    """A run of `plan` whose --warmup-epochs give the plan's warm-up (2 steps an epoch)."""
    cfg = TrainConfig(method=method, data="synthetic", batch_size=4, precision="float64", threads=1, out=str(tmp_path),
                      random_init_knn=False, signal_images=0, online_probe=False, warmup_epochs=warmup_epochs,
                      time_budget=f"{plan['budget_s']:g}s", time_budget_plan=plan,
                      distributed=DistributedConfig(backend="local", world_size=1)).validate()
    init_distributed(cfg.distributed)
    return cfg, build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))


def _steps(hook, run, now, steps, seconds, trained=None):
    """Steps `steps` through the hook, each `seconds(step)` long on the budget's clock; `trained` collects the
    learning rate each step trained at (1-based step `k` is optimiser step ``k - 1``)."""
    for step in steps:
        if trained is not None:
            trained.append(run.schedule.lr(step - 1))
        now[0] += seconds(step)
        hook.after_step(run, StepEnd(step, 0.1, torch.zeros(()), epoch_done=False, last=False))


def _hook(monkeypatch, cfg, now, start_s=0.0, untimed=lambda step: False):
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = BudgetClock(cfg.time_budget)
    clock.started, clock.reserve_s = start_s, 1.0
    lines, written = [], []
    hook = ReplanHook(clock, lines.append, lambda: written.append(dict(cfg.time_budget_plan)), untimed=untimed)
    return hook, clock, lines, written


def test_the_checks_come_once_five_steps_are_timed_every_five_in_the_open_warmup_then_every_tenth():
    assert next_check(100, 10, timed_from=1) == 6               # inside the warm-up: its length still open
    assert next_check(100, 10, timed_from=6) == 11              # kept: the warm-up is still open
    assert next_check(100, 10, timed_from=8) == 13              # the first check past the warm-up's end
    assert next_check(44, 4, timed_from=1) == 6                 # a short warm-up: as soon as 5 steps are timed
    assert next_check(100, 10, timed_from=10) == 20             # then a tenth of the plan on
    assert next_check(100, 0, timed_from=6) == 16               # the warm-up planned again: a tenth on
    assert next_check(1000, 10, timed_from=10) == 110
    assert next_check(30, 0, timed_from=3) == 8                 # at least 5 steps timed
    assert next_check(100, 10, timed_from=85) == 95
    assert next_check(100, 10, timed_from=86) is None           # none in the last 5 steps


def test_the_warmup_is_open_until_the_first_replan(tmp_path, local_group):
    cfg, run = _run(tmp_path, _plan(100, 10))
    assert open_warmup(run) == 10
    cfg.time_budget_plan = {**_plan(100, 10), "replanned": {"after_step": 6, "first_steps": 120, "step_s": 1.0}}
    assert open_warmup(run) == 0
    cfg.time_budget_plan = {**_plan(100, 10), "stretch": {"knots": [[6, 6]], "length": 120}}
    assert open_warmup(run) == 0


def test_far_from_plan_is_more_than_a_fiftieth_of_the_steps_left_and_more_than_a_step():
    assert not far_from_plan(50, 100, 51 + 50)                 # 1 step off of 50 left
    assert far_from_plan(50, 100, 98) and far_from_plan(50, 100, 102)
    assert not far_from_plan(90, 100, 101)                     # near the end: a step is noise
    assert far_from_plan(6, 44, 15)


def test_a_windows_pace_leaves_out_its_planned_periodic_work():
    assert window_step_s(20.0, 10, planned_work_s=4.0) == pytest.approx(1.6)
    assert window_step_s(20.0, 10, planned_work_s=50.0) == pytest.approx(1.0)   # at least half the plain mean


def test_the_steps_that_fit_are_the_first_plans_rule_from_the_step_reached():
    """plan_steps from step `at`: the steps left and their periodic work fit what is left after the time spent."""
    costs = BudgetCosts(spent_s=30.0, step_s=2.0, knn_s=2.0, signals_s=0.0, checkpoint_copy_s=0.5, checkpoint_s=1.0)
    cadence = Cadence(steps_per_epoch=50, eval_every=1, signals=False)
    n = plan_steps(600.0, costs, cadence, at=10)
    room = 600.0 * (1 - budget.MARGIN_SHARE) - 30.0 - reserve_of(costs, cadence)
    assert (n - 10) * 2.0 + cadence.work_s(costs, n, 10) <= room < (n + 1 - 10) * 2.0 + cadence.work_s(costs, n + 1, 10)
    assert cadence.work_s(costs, 200, 10, 120) == 2 * (2.0 + 0.5)        # the epoch ends at steps 50 and 100
    assert cadence.work_s(costs, 200) == cadence.periodic_s(200, costs) == 3 * 2.5   # 50, 100, 150 (200: the end)
    assert plan_steps(600.0, costs, cadence, cap=50, at=10) == 50
    assert plan_steps(600.0, BudgetCosts(**{**asdict(costs), "spent_s": 599.0}), cadence, at=10) == 10


def test_a_slower_run_replans_inside_its_warmup_for_the_steps_that_fit(tmp_path, local_group, monkeypatch):
    """Planned for 100 steps of 1 s, the steps take 2 s: after step 6 (five timed steps, inside the 10-step warm-up)
    the run plans the steps that fit, and the lr's cosine and BYOL's momentum end exactly there; the warm-up, by the
    first plan's rule, stays 10 steps, so the rates trained so far are those of the new plan. The next check times a
    tenth of the new plan and keeps it."""
    cfg, run = _run(tmp_path, _plan(100, 10))
    warmup_lrs = [run.schedule.lr(s) for s in range(10)]
    now = [10.0]                                   # start-up, data, the first measurement
    hook, _, lines, written = _hook(monkeypatch, cfg, now)
    hook.start(run, 0)
    _steps(hook, run, now, range(1, 8), lambda step: 2.0)
    expected = plan_steps(600, BudgetCosts(**{**asdict(FIRST), "spent_s": 22.0, "step_s": 2.0}), NO_WORK, at=6)
    assert 250 < expected < 300 and run.total_steps == run.method.steps_total == cfg.time_budget_plan["steps"] == expected
    assert cfg.time_budget_plan["replanned"] == {"after_step": 6, "first_steps": 100, "step_s": 2.0}
    assert run.schedule.warmup_steps == cfg.time_budget_plan["warmup_steps"] == 10
    assert [run.schedule.lr(s) for s in range(10)] == warmup_lrs
    assert run.schedule.lr(expected - 1) > 0 and run.schedule.lr(expected) == 0.0 and run.method.momentum(expected) == 1.0
    assert len(written) == 1 and lines == [f"time budget 600s: re-planned after step 6 from 5 trained steps of 2 s: "
                                           f"{expected} steps, 10 of them warm-up (first plan: 100 steps, 10 warm-up, "
                                           "of 1 s)"]
    assert hook.at == 6 + max(5, math.ceil(expected / 10))   # not every five steps any more
    _steps(hook, run, now, range(8, hook.at + 1), lambda step: 2.0)
    assert len(lines) == 1 and cfg.time_budget_plan["steps"] == expected


def test_a_replan_from_step_0_takes_the_first_plans_rule_for_the_warmup(tmp_path, local_group, monkeypatch):
    """A first plan of 180 steps warms up for 18 (a tenth); its steps take 20 s, not 1: after step 6 few fit, and
    their warm-up is the first plan's rule for them, but never shorter than the 6 steps already trained on the ramp
    (a shorter one would leave the ramp for the cosine's decay before the peak): the rate trained never falls
    while it warms up, and the line names the warm-up trained."""
    cfg, run = _run(tmp_path, _plan(180, 18), warmup_epochs=9.0)
    now = [10.0]
    hook, _, lines, _ = _hook(monkeypatch, cfg, now)
    hook.start(run, 0)
    trained: list[float] = []
    _steps(hook, run, now, range(1, 7), lambda step: 20.0, trained)
    plan = cfg.time_budget_plan
    steps = plan["steps"]
    assert steps == run.total_steps < 40 and plan["replanned"]["after_step"] == 6
    assert budget_warmup(steps, 9.0, 2) < 6 == plan["warmup_steps"] == run.schedule.warmup_steps
    trained += [run.schedule.lr(s) for s in range(6, steps + 1)]
    assert all(b >= a for a, b in zip(trained[:7], trained[1:7])) and trained[6] == run.schedule.peak_lr
    assert trained[steps] == 0.0 and f"{steps} steps, 6 of them warm-up" in lines[0]


def test_a_check_at_the_end_of_the_warmup_keeps_it_and_goes_on_from_the_peak(tmp_path, local_group, monkeypatch):
    """The user's case: a check that falls on the warm-up's last step (a 6-step warm-up, steps timed from step 1)
    finds the warm-up trained: it is not planned again (shortened there, the rate would fall from the peak into
    the cosine); the steps left are laid onto the schedules, which go on from the peak."""
    first = plan_steps(120, FIRST, NO_WORK)   # right for 1-second steps
    cfg, run = _run(tmp_path, _plan(first, 6, budget_s=120.0), warmup_epochs=3.0)
    before = [run.schedule.lr(s) for s in range(7)]
    now = [10.0]
    hook, _, lines, _ = _hook(monkeypatch, cfg, now)
    hook.start(run, 0)
    trained: list[float] = []
    _steps(hook, run, now, range(1, 7), lambda step: 3.0, trained)
    plan = cfg.time_budget_plan
    assert "stretch" in plan and "replanned" not in plan and plan["warmup_steps"] == run.schedule.warmup_steps == 6
    assert plan["steps"] < first / 2 and plan["late"][0]["after_step"] == 6 and [run.schedule.lr(s) for s in range(7)] == before
    trained += [run.schedule.lr(s) for s in range(6, plan["steps"] + 1)]
    assert all(b >= a for a, b in zip(trained[:7], trained[1:7])) and trained[6] == run.schedule.peak_lr
    assert 0.9 * trained[6] < trained[7] < trained[6] and trained[plan["steps"]] == 0.0
    assert "the schedules go on from where they are" in lines[0] and "warm-up" not in lines[0]


def test_a_late_replan_on_the_ramp_names_where_its_warmup_now_ends(tmp_path, local_group):
    """Planned again from step 0 once (its warm-up no longer open), a check still on the ramp lays it onto the
    steps left with the rest: the rate goes on rising from where it stands, and the line says where it peaks."""
    plan = {**_plan(100, 10), "replanned": {"after_step": 2, "first_steps": 120, "step_s": 1.0}}
    cfg, run = _run(tmp_path, plan)
    lr_4 = run.schedule.lr(4)
    cfg.time_budget_plan, why = replanned(plan, run, 5, 50, 2.0, 3)
    apply_plan(run)
    assert cfg.time_budget_plan["stretch"] == {"knots": [[5, 5]], "length": 100}
    assert run.schedule.lr(4) == lr_4 and "its warm-up now ending at step 8" in why   # 5 + 5 * 45 / 95
    ramp = [run.schedule.lr(s) for s in range(4, 8)]   # the ramp's positions: 4, 5, 7.1, 9.2 (capped at the peak)
    assert all(b > a for a, b in zip(ramp, ramp[1:])) and ramp[-1] == run.schedule.peak_lr > run.schedule.lr(8)


def test_a_run_far_slower_than_measured_replans_once_five_steps_are_timed(tmp_path, local_group, monkeypatch):
    """Planned from two timed steps for 44 steps of 1 s in 60 s, the steps take 3 s: the run re-plans after step 6
    (five timed steps, past its 4-step warm-up), to the 15 that fit, and its schedules end there without a jump
    (it was ended by the clock at step 15 of 44, its learning rate at 77 % of the peak)."""
    cfg, run = _run(tmp_path, _plan(44, 4, budget_s=60.0), warmup_epochs=2.0)
    before = [run.schedule.lr(s) for s in range(7)]
    now = [10.0]
    hook, _, lines, _ = _hook(monkeypatch, cfg, now)
    hook.start(run, 0)
    _steps(hook, run, now, range(1, 7), lambda step: 3.0)
    plan = cfg.time_budget_plan
    assert run.total_steps == plan["steps"] == 15 and plan["late"][0] == {"after_step": 6, "steps_before": 44,
                                                                         "step_s": 3.0}
    assert plan["stretch"] == {"knots": [[6, 6]], "length": 44} and plan["warmup_steps"] == 4
    assert [run.schedule.lr(s) for s in range(7)] == before
    assert run.schedule.lr(14) > 0 and run.schedule.lr(15) == 0.0 and run.method.momentum(15) == 1.0
    assert "re-planned after step 6 from its last 5 steps" in lines[0]


def test_profiled_steps_are_not_timed(tmp_path, local_group, monkeypatch):
    """Steps 2 to 4 are profiled and take 6 s more each (the profiler, its trace): the check at step 9 times the
    five steps after them, 1 s each, and plans the steps those fit in what the profile left of the budget."""
    steps = plan_steps(120, FIRST, NO_WORK)   # the first plan, right for 1-second steps
    cfg, run = _run(tmp_path, _plan(steps, 10, budget_s=120.0))
    now = [10.0]
    hook, clock, lines, _ = _hook(monkeypatch, cfg, now, untimed=lambda step: 2 <= step <= 4)
    hook.start(run, 0)
    _steps(hook, run, now, range(1, 10), lambda step: 7.0 if 2 <= step <= 4 else 1.0)
    plan = cfg.time_budget_plan
    assert plan["replanned"]["step_s"] == 1.0 and "re-planned after step 9 from 5 trained steps of 1 s" in lines[0]
    expected = plan_steps(120, BudgetCosts(**{**asdict(FIRST), "spent_s": clock.spent_s()}), NO_WORK, at=9)
    assert plan["steps"] == expected == steps - 18
    assert plan["warmup_steps"] == max(9, budget_warmup(expected, 5.0, 2))   # never shorter than the steps trained


def test_a_run_on_plan_keeps_it_and_its_reserve_follows_the_pace(tmp_path, local_group, monkeypatch):
    """Resumed at step 5 of a plan its steps keep to: every check keeps the plan; the clock's reserve for the end is
    the final work and one step at the pace measured."""
    steps = plan_steps(120, FIRST, NO_WORK)
    cfg, run = _run(tmp_path, _plan(steps, 10, budget_s=120.0))
    now = [15.0]
    hook, clock, lines, written = _hook(monkeypatch, cfg, now)
    hook.start(run, 5)
    _steps(hook, run, now, range(6, steps - 1), lambda step: 1.0)
    assert run.total_steps == steps and "replanned" not in cfg.time_budget_plan and not lines and not written
    assert clock.reserve_s == reserve_of(FIRST, NO_WORK) == 1.0


def test_a_run_turned_slower_replans_late_without_a_jump(tmp_path, local_group, monkeypatch):
    """Resumed at step 20 of 100 with 440 s of 600 spent, 2 s a step: at the check after step 31, 93 steps fit, so
    the run takes 93; the lr and BYOL's momentum go on from their step-31 values and end at step 93. At the next
    check the steps still fit: the plan stays."""
    cfg, run = _run(tmp_path, {**_plan(100, 10), "replanned": {"after_step": 10, "first_steps": 120, "step_s": 1.0}})
    before = [run.schedule.lr(s) for s in range(32)]
    momentum_31 = run.method.momentum(31)
    now = [440.0]
    hook, _, lines, written = _hook(monkeypatch, cfg, now)
    hook.start(run, 20)
    _steps(hook, run, now, range(21, 60), lambda step: 2.0)
    plan = cfg.time_budget_plan
    assert run.total_steps == plan["steps"] == 93 and run.method.steps_total == 100
    assert plan["stretch"] == {"knots": [[31, 31]], "length": 100} and plan["late"][0]["steps_before"] == 100
    assert [run.schedule.lr(s) for s in range(32)] == before and run.method.momentum(31) == momentum_31
    assert run.schedule.lr(92) > 0 and run.schedule.lr(93) == 0.0 and run.method.momentum(93) == 1.0
    assert run.method.momentum(70) < run.method.momentum(71) < 1.0
    assert len(written) == 1 and len(lines) == 1 and "re-planned after step 31 from its last 10 steps" in lines[0]
    assert "93 steps (were 100)" in lines[0]

    # resumed from a checkpoint of this run: the same schedules, built from the plan it recorded
    shutdown_distributed(None)
    cfg2 = TrainConfig(**{**cfg.__dict__, "time_budget_plan": dict(plan)}).validate()
    init_distributed(cfg2.distributed)
    again = build_run(cfg2, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    assert [again.schedule.lr(s) for s in range(94)] == [run.schedule.lr(s) for s in range(94)]
    assert again.method.momentum(80) == run.method.momentum(80) and again.method.steps_total == 100


def test_dino_teacher_temperature_follows_the_stretch(tmp_path, local_group):
    cfg, run = _run(tmp_path, _plan(100, 10), "dino")
    temps = [run.method.teacher_temp(s) for s in range(12)]
    cfg.time_budget_plan = {**cfg.time_budget_plan, "steps": 60, "stretch": {"knots": [[5, 5.0]], "length": 100}}
    apply_plan(run)
    assert [run.method.teacher_temp(s) for s in range(6)] == temps[:6]
    assert run.method.teacher_temp(6) > temps[6]   # the warm-up of 10 schedule steps now ends at step ~7


@pytest.mark.parametrize("stretch", [{"knots": [[50, 50.0]]}, {"knots": [[60, 50.0], [50, 55.0]], "length": 100},
                                     {"knots": [[150, 50.0]], "length": 100}, "knots"])
def test_a_malformed_stretch_is_one_line(stretch, tmp_path):
    with pytest.raises(ConfigError, match="stretch must be the record a late re-plan writes"):
        TrainConfig(method="simclr", data="synthetic", time_budget="10m", out=str(tmp_path),
                    time_budget_plan={**_plan(100, 10), "stretch": stretch}).validate()
