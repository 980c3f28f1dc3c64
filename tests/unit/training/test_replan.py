"""A budgeted run plans its steps again at the end of its warm-up, from the steps it trained: the count follows the
real step time, the warm-up's learning rates stay, and every schedule ends at the new last step."""

from dataclasses import asdict

import pytest
import torch

from unison.config import DistributedConfig, TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.training import budget
from unison.training.budget import MARGIN_SHARE, BudgetClock, BudgetCosts, Cadence
from unison.training.hooks import StepEnd
from unison.training.replan import ReplanHook, replan_step, replanned_steps
from unison.training.step import build_run

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
