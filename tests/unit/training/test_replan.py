"""A budgeted run plans its steps again at the end of its warm-up, from the steps it trained: the count follows the
real step time, the warm-up's learning rates stay, and every schedule ends at the new last step. Late in the run it
checks again, from the steps since: a run turned slower takes fewer steps, its schedules go on from where they were
(no jump) and end at its new last step; one on time keeps its plan."""

from dataclasses import asdict

import pytest
import torch

from unison.config import DistributedConfig, TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.errors import ConfigError
from unison.training import budget
from unison.training.budget import MARGIN_SHARE, BudgetClock, BudgetCosts, Cadence
from unison.training.hooks import StepEnd
from unison.training.replan import ReplanHook, late_step, late_steps, replan_step, replanned_steps
from unison.training.step import apply_plan, build_run

FIRST = BudgetCosts(spent_s=10.0, step_s=1.0, knn_s=0.0, signals_s=0.0, checkpoint_copy_s=0.0, checkpoint_s=0.0)


@pytest.fixture
def local_group():
    yield
    shutdown_distributed(None)


def _plan(steps: int, warmup: int) -> dict:
    return {"budget_s": 600.0, "steps": steps, "warmup_steps": warmup, "reserve_s": 1.0, "why": "measured",
            "measured": asdict(FIRST)}


def test_the_replan_comes_at_the_end_of_the_warmup_and_once():
    assert replan_step(_plan(100, 10)) == 10
    assert replan_step(_plan(1000, 10)) == 100                 # no earlier than a tenth of the steps
    assert replan_step(_plan(20, 3)) is None                   # 2 steps to time: the first plan stays
    assert replan_step({**_plan(100, 10), "replanned": {}}) is None


def test_replanned_steps_follow_the_trained_step_time():
    cadence = Cadence(steps_per_epoch=50, signals=False)
    # 10 steps of 2 s after 10 s of start-up: the first plan's rule with a 2 s step
    room = 600 * (1 - MARGIN_SHARE) - 10 - 2
    assert replanned_steps(600, FIRST, cadence, 10, 30.0, 2.0, None) == int(room / 2)
    assert replanned_steps(600, FIRST, cadence, 10, 30.0, 2.0, 50) == 50          # --max-steps still caps it
    assert replanned_steps(600, FIRST, cadence, 10, 599.0, 2.0, None) == 11       # no time left: the clock ends it


def test_a_slower_run_replans_its_schedules_for_the_steps_that_fit(tmp_path, local_group, monkeypatch):
    """Planned for 100 steps of 1 s, the steps take 2 s: after step 10 (the warm-up's end) the run plans 288 steps,
    and the lr's cosine and BYOL's momentum end exactly there; the warm-up's rates are those of the first plan."""
    cfg = TrainConfig(method="byol", data="synthetic", batch_size=4, precision="float64", threads=1, out=str(tmp_path),
                      random_init_knn=False, signal_images=0, online_probe=False, time_budget="10m",
                      time_budget_plan=_plan(100, 10),
                      distributed=DistributedConfig(backend="local", world_size=1)).validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    warmup_lrs = [run.schedule.lr(s) for s in range(10)]
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = BudgetClock("10m")
    clock.planned_here = True
    lines, written = [], []
    hook = ReplanHook(clock, lines.append, lambda: written.append(dict(cfg.time_budget_plan)))
    hook.start(run, 0)
    now[0] = 10.0                                  # start-up, data, the first measurement
    for step in range(1, 13):
        now[0] += 2.0
        hook.after_step(run, StepEnd(step, 0.1, torch.zeros(()), epoch_done=False, last=False))
    expected = replanned_steps(600, FIRST, Cadence(steps_per_epoch=run.steps_per_epoch, signals=False), 10, 30.0,
                               2.0, None)
    assert expected == 288 and run.total_steps == run.method.steps_total == cfg.time_budget_plan["steps"] == 288
    assert cfg.time_budget_plan["replanned"] == {"after_step": 10, "first_steps": 100, "step_s": 2.0}
    assert [run.schedule.lr(s) for s in range(10)] == warmup_lrs
    assert run.schedule.lr(287) > 0 and run.schedule.lr(288) == 0.0 and run.method.momentum(288) == 1.0
    assert len(written) == 1 and "re-planned after step 10 from 9 trained steps of 2 s: 288 steps" in lines[0]


def test_a_resumed_run_keeps_its_plan(tmp_path, local_group):
    cfg = TrainConfig(method="simclr", data="synthetic", batch_size=4, threads=1, out=str(tmp_path),
                      random_init_knn=False, signal_images=0, online_probe=False, time_budget="10m",
                      time_budget_plan=_plan(100, 10),
                      distributed=DistributedConfig(backend="local", world_size=1)).validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    hook = ReplanHook(BudgetClock("10m"), print, lambda: None)   # planned by an earlier attempt
    hook.start(run, 5)
    for step in range(6, 12):
        hook.after_step(run, StepEnd(step, 0.1, torch.zeros(()), epoch_done=False, last=False))
    assert run.total_steps == 100 and "replanned" not in cfg.time_budget_plan


def test_late_checks_come_at_half_and_four_fifths_of_the_plan():
    assert late_step(_plan(100, 10), timed_from=10) == (50, 0.5)
    assert late_step(_plan(100, 10), timed_from=50) == (80, 0.8)
    assert late_step(_plan(100, 10), timed_from=78) is None    # too few steps to time before the last check
    assert late_step(_plan(100, 10), timed_from=47) == (80, 0.8)
    assert late_step(_plan(150, 10), timed_from=80, shares=()) is None   # each share is checked once


def test_each_late_check_is_made_once_even_when_the_plan_grows_past_it(tmp_path, local_group, monkeypatch):
    """On plan at step 50; twice as fast from there: at step 80 (four fifths) 150 steps fit. Four fifths of 150
    is step 120, but that check was made: no third one (a 5-minute CPU run checked again 5 steps later)."""
    cfg, run = _late_run(tmp_path)
    now = [427.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = BudgetClock("10m")
    clock.started, clock.reserve_s = 0.0, 1.0
    lines = []
    hook = ReplanHook(clock, lines.append, lambda: None)
    hook.start(run, 20)
    for step in range(21, 131):
        now[0] += 2.0 if step <= 50 else 1.0
        hook.after_step(run, StepEnd(step, 0.1, torch.zeros(()), epoch_done=False, last=False))
        if step == 50:
            assert run.total_steps == 100 and hook.late_at == 80 and not lines   # on plan: kept
    assert run.total_steps == 150 and len(lines) == 1 and "re-planned after step 80" in lines[0]
    assert hook.late_at is None and cfg.time_budget_plan["stretch"]["knots"] == [[80, 80]]


def test_late_steps_follow_the_time_left_and_keep_a_plan_that_is_close():
    assert late_steps(50, 100, left_s=100.0, step_s=2.0, cap=None) is None          # 50 steps fit: on plan
    assert late_steps(50, 100, left_s=101.0, step_s=2.0, cap=None) is None          # within a fiftieth of 50
    assert late_steps(50, 100, left_s=80.0, step_s=2.0, cap=None) == 90
    assert late_steps(50, 100, left_s=200.0, step_s=2.0, cap=None) == 150
    assert late_steps(50, 100, left_s=200.0, step_s=2.0, cap=100) is None            # --max-steps caps it
    assert late_steps(50, 100, left_s=-5.0, step_s=2.0, cap=None) == 51             # no time left: the clock ends it


def _late_run(tmp_path, method: str = "byol"):
    plan = {**_plan(100, 10), "replanned": {"after_step": 10, "first_steps": 120, "step_s": 1.0}}
    cfg = TrainConfig(method=method, data="synthetic", batch_size=4, precision="float64", threads=1, out=str(tmp_path),
                      random_init_knn=False, signal_images=0, online_probe=False, time_budget="10m",
                      time_budget_plan=plan, distributed=DistributedConfig(backend="local", world_size=1)).validate()
    init_distributed(cfg.distributed)
    return cfg, build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))


def test_a_run_turned_slower_replans_late_without_a_jump(tmp_path, local_group, monkeypatch):
    """Resumed at step 20 of 100 with 500 s of 600 spent by step 50 (2 s a step): 43 steps fit after step 50, so
    the run takes 93; the lr and BYOL's momentum go on from their step-50 values and end at step 93. At step 75
    the steps still fit: the plan stays."""
    cfg, run = _late_run(tmp_path)
    before = [run.schedule.lr(s) for s in range(51)]
    momentum_50 = run.method.momentum(50)
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = BudgetClock("10m")
    clock.reserve_s = 1.0
    lines, written = [], []
    hook = ReplanHook(clock, lines.append, lambda: written.append(dict(cfg.time_budget_plan)))
    hook.start(run, 20)
    now[0] = 440.0
    for step in range(21, 76):
        now[0] += 2.0
        hook.after_step(run, StepEnd(step, 0.1, torch.zeros(()), epoch_done=False, last=False))
    plan = cfg.time_budget_plan
    assert run.total_steps == plan["steps"] == 93 and run.method.steps_total == 100
    assert plan["stretch"] == {"knots": [[50, 50]], "length": 100} and plan["late"][0]["steps_before"] == 100
    assert [run.schedule.lr(s) for s in range(51)] == before and run.method.momentum(50) == momentum_50
    assert run.schedule.lr(92) > 0 and run.schedule.lr(93) == 0.0 and run.method.momentum(93) == 1.0
    assert run.method.momentum(70) < run.method.momentum(71) < 1.0
    assert len(written) == 1 and len(lines) == 1 and "re-planned after step 50 from its last 29 steps" in lines[0]
    assert "93 steps (were 100)" in lines[0]

    # resumed from a checkpoint of this run: the same schedules, built from the plan it recorded
    shutdown_distributed(None)
    cfg2 = TrainConfig(**{**cfg.__dict__, "time_budget_plan": dict(plan)}).validate()
    init_distributed(cfg2.distributed)
    again = build_run(cfg2, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    assert [again.schedule.lr(s) for s in range(94)] == [run.schedule.lr(s) for s in range(94)]
    assert again.method.momentum(80) == run.method.momentum(80) and again.method.steps_total == 100


def test_dino_teacher_temperature_follows_the_stretch(tmp_path, local_group):
    cfg, run = _late_run(tmp_path, "dino")
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
