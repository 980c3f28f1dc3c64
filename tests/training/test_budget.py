"""``--time-budget``: durations, the planner (steps from measured costs), schedules planned for exactly those steps,
and measurement steps that leave no trace (a budgeted run trains from step 0 as a run of its planned length)."""

import json

import pytest
import torch

from unison.config import DistributedConfig, TrainConfig
from unison.config.budget import parse_duration
from unison.data.synthetic import synthetic_dataset
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.errors import ConfigError
from unison.training import budget
from unison.training.budget import (
    MARGIN_SHARE,
    BudgetClock,
    BudgetCosts,
    Cadence,
    Snapshot,
    budget_warmup,
    final_s,
    plan_budget,
    plan_steps,
)
from unison.training.step import accumulated_forward_backward, batches, build_run, grouped, optimizer_step


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("10m", 600), ("2h", 7200), ("1h30m", 5400), ("1.5h", 5400),
                                           ("600", 600), (" 2M ", 120)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10 minutes", "m", "-5m", "0s", "2y", "10m5", "1e9h"])
def test_bad_durations_say_how_to_write_one(text):
    with pytest.raises(ConfigError, match="--time-budget"):
        parse_duration(text)


COSTS = BudgetCosts(spent_s=10.0, step_s=0.5, knn_s=4.0, signals_s=0.0, checkpoint_copy_s=0.0, checkpoint_s=1.0)


def test_planned_steps_are_the_most_that_fit():
    cadence = Cadence(steps_per_epoch=100, signals=False)
    # 100 s: 2 % margin, 10 s spent, 4 s kNN + 1 s checkpoint at the end, one step of stop delay -> 82.5 s of steps
    assert plan_steps(100.0, COSTS, cadence) == 165
    assert plan_steps(100.0, COSTS, cadence, cap=40) == 40
    assert plan_steps(14.0, COSTS, cadence) == 0   # the end alone does not fit


def test_periodic_work_is_planned_for():
    """Epoch checkpoints, --eval-every kNN and the signals take time from the steps."""
    costs = BudgetCosts(spent_s=0.0, step_s=0.1, knn_s=2.0, signals_s=0.5, checkpoint_copy_s=0.25, checkpoint_s=1.0)
    cadence = Cadence(steps_per_epoch=50, eval_every=1, signals_every=100)
    n = plan_steps(300.0, costs, cadence)
    room = 300.0 * (1 - MARGIN_SHARE) - final_s(costs, cadence) - costs.step_s
    assert n * costs.step_s + cadence.periodic_s(n, costs) <= room < (n + 1) * costs.step_s + cadence.periodic_s(
        n + 1, costs)
    # 8 complete epochs before the last: 8 checkpoints and 8 kNN; signals at the start and every 100 steps
    assert cadence.periodic_s(450, costs) == pytest.approx(8 * 0.25 + 8 * 2.0 + 5 * 0.5)
    assert n < plan_steps(300.0, costs, Cadence(steps_per_epoch=50, signals=False))


def test_warmup_of_a_budgeted_run_is_at_most_a_tenth():
    assert budget_warmup(1000, 2.0, 100) == 100   # --warmup-epochs 2 = 200 steps, cut to a tenth
    assert budget_warmup(1000, 0.5, 100) == 50
    assert budget_warmup(1, 2.0, 100) == 0


def _cfg(tmp_path, **kw):
    return TrainConfig(**{"method": "byol", "data": "synthetic", "batch_size": 4, "precision": "float64",
                          "threads": 1, "out": str(tmp_path), "random_init_knn": False, "signal_images": 0,
                          "online_probe": False, "distributed": DistributedConfig(backend="local", world_size=1),
                          **kw})


@pytest.fixture
def local_group():
    yield
    shutdown_distributed(None)


def test_schedules_end_exactly_at_the_planned_last_step(tmp_path, local_group):
    """A plan of 37 steps: the learning rate's cosine reaches 0 and BYOL's momentum 1 exactly at step 37."""
    plan = {"budget_s": 600.0, "steps": 37, "warmup_steps": 3, "reserve_s": 1.0, "why": "test"}
    cfg = _cfg(tmp_path, time_budget="10m", time_budget_plan=plan).validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    assert run.total_steps == run.method.steps_total == 37 and run.schedule.warmup_steps == 3
    assert run.schedule.lr(36) > 0 and run.schedule.lr(37) == 0.0
    assert run.method.momentum(36) < 1.0 and run.method.momentum(37) == 1.0
    assert run.resolved["total_steps"] == 37


def test_a_plan_for_another_budget_is_refused(tmp_path):
    plan = {"budget_s": 600.0, "steps": 37, "warmup_steps": 3}
    with pytest.raises(ConfigError, match="planned for a 600 s budget"):
        _cfg(tmp_path, time_budget="20m", time_budget_plan=plan).validate()
    with pytest.raises(ConfigError, match="time_budget_plan"):
        _cfg(tmp_path, time_budget="10m", time_budget_plan={"steps": "many"}).validate()


def _train(run, steps):
    for micro in grouped(batches(run, 0), run.accumulate):
        if micro[0].step == steps:
            break
        accumulated_forward_backward(run, micro)
        optimizer_step(run, micro[0].step)
    return {k: v.clone() for k, v in run.method.state_dict().items()}


def test_measured_steps_leave_no_trace(tmp_path, local_group):
    """Snapshot, 4 steps, restore, then 3 steps == 3 steps of a fresh run (weights, BYOL's EMA, optimizer momentum)."""
    cfg = _cfg(tmp_path, max_steps=8).validate()
    init_distributed(cfg.distributed)
    data = synthetic_dataset(8, 16, 0)
    fresh = _train(build_run(cfg, torch.device("cpu"), train_set=data), 3)
    run = build_run(cfg, torch.device("cpu"), train_set=data)
    snapshot = Snapshot(run)
    measured = _train(run, 4)
    assert any(not torch.equal(measured[k], fresh[k]) for k in fresh), "the measurement changed nothing: vacuous"
    snapshot.restore(run)
    again = _train(run, 3)
    for k, v in fresh.items():
        assert torch.equal(v, again[k]), k


def test_plan_budget_measures_plans_and_applies(tmp_path, local_group, monkeypatch):
    monkeypatch.setattr(budget, "TIMED_STEPS", (2, 3))   # a short measurement: this test checks the plumbing
    cfg = _cfg(tmp_path, time_budget="1h", max_steps=500, method="simclr").validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    plan = plan_budget(run, BudgetClock(cfg.time_budget))
    assert plan["steps"] == 500 and "capped by --max-steps 500" in plan["why"]   # a tiny step: the cap decides
    assert cfg.time_budget_plan is plan and run.total_steps == run.method.steps_total == 500
    assert plan["measured"]["step_s"] > 0 and plan["reserve_s"] > 0
    json.dumps(plan)   # config.json and the checkpoints hold it
    assert not list(tmp_path.glob(".budget-*")), "the checkpoint-time probe file was left behind"


def test_a_restarted_run_takes_its_plan_from_the_checkpoint(tmp_path, monkeypatch):
    """Restarts by the launcher and SLURM requeues rerun the original command (no plan in it): the checkpoint's
    plan is adopted before the build, never measured again."""
    plan = {"budget_s": 600.0, "steps": 37, "warmup_steps": 3, "reserve_s": 1.0, "why": "test"}

    class Header:
        config = {"time_budget_plan": plan}

    monkeypatch.setattr(budget, "read_header", lambda path: Header)
    cfg = _cfg(tmp_path, time_budget="10m", resume=str(tmp_path))
    BudgetClock(cfg.time_budget).adopt_plan(cfg)
    assert cfg.time_budget_plan == plan
    other = _cfg(tmp_path, time_budget="20m", resume=str(tmp_path))
    with pytest.raises(ConfigError, match="planned for a 600 s budget"):
        BudgetClock(other.time_budget).adopt_plan(other)


def test_a_run_capped_below_the_measurement_does_not_time_its_first_steps(tmp_path, local_group, monkeypatch):
    """--max-steps 2 with a budget: its steps come round again until the warm-up and the timed steps are done, so
    the first steps, which compile with --compile (72 s each on a loaded CPU, and the plan found no time left to
    train), are not timed; the plan is the cap."""
    monkeypatch.setattr(budget, "TIMED_STEPS", (2, 3))
    taken: list[int] = []
    real_step = budget.optimizer_step
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])   # the budget's clock: the steps take what the test says

    def compiling_at_first(run, step):
        taken.append(step)
        now[0] += 50.0 if len(taken) <= budget.WARMUP_MEASURE_STEPS else 0.1   # a compiling step, then steady ones
        return real_step(run, step)

    monkeypatch.setattr(budget, "optimizer_step", compiling_at_first)
    cfg = _cfg(tmp_path, time_budget="1h", max_steps=2, method="simclr").validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    plan = plan_budget(run, BudgetClock(cfg.time_budget))
    assert plan["steps"] == run.total_steps == 2 and "timed over 3 steps after 3 warm-up steps" in plan["why"]
    assert taken == [0, 1, 0, 1, 0, 1] and plan["measured"]["step_s"] == pytest.approx(0.1), plan


def test_epochs_given_beside_a_budget_are_said_to_be_unused(tmp_path):
    # the budget planned over --epochs without a word (--time-budget 30s --epochs 1 trained 215 steps of digits)
    import warnings

    from unison.cli.train_args import parse_train_args

    with pytest.warns(UserWarning, match=r"--time-budget 30s sets this run's length, so epochs=1 is not used"):
        cfg = parse_train_args(["--time-budget", "30s", "--epochs", "1", "--out", str(tmp_path / "a")])
    assert cfg.epochs == 1
    yaml = tmp_path / "recipe.yaml"
    yaml.write_text("epochs: 200\ntime_budget: 5m\n")   # a recipe file's epochs too
    with pytest.warns(UserWarning, match="epochs=200 is not used"):
        parse_train_args(["--config", str(yaml), "--preset", "speedrun", "--out", str(tmp_path / "b")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no budget, or no epochs given: nothing to say
        parse_train_args(["--epochs", "1", "--out", str(tmp_path / "c")])
        parse_train_args(["--time-budget", "30s", "--out", str(tmp_path / "d")])


def _used(**kw):
    return {"budget_s": 20.0, "used_s": 19.0, "planned_steps": 21, "steps": 21, "stopped_by_clock": False,
            "over_s": 0.0, "schedule_finished": True, **kw}


def test_the_result_line_says_an_overrun_and_an_unfinished_schedule():
    """Every figure as measured: 'used 25.3 s of 20 s, 21 of 21 planned steps' said nothing of 5.3 s over, and a
    run the clock ended at step 15 of 44 nothing of its learning rate, still at 77 % of the peak."""
    assert budget.used_line("20s", _used(), False) == "time budget 20s: used 19.0 s of 20 s, 21 of 21 planned steps"
    over = budget.used_line("20s", _used(used_s=25.3, over_s=5.3), False)
    assert over == "time budget 20s: used 25.3 s of 20 s, 5.3 s over budget, 21 of 21 planned steps"
    assert "less than 0.1 s over budget" in budget.used_line("20s", _used(used_s=20.04, over_s=0.04), False)
    ended = budget.used_line("60s", _used(budget_s=60.0, used_s=61.2, over_s=1.2, planned_steps=44, steps=15,
                                          stopped_by_clock=True, schedule_finished=False, last_lr_share=0.7712), False)
    assert ended == ("time budget 60s: used 61.2 s of 60 s, 1.2 s over budget, 15 of 44 planned steps: the steps ran "
                     "slower than planned and the clock ended the run, its learning-rate schedule unfinished (the "
                     "last step at 77% of the peak rate)")
    spent = budget.used_line("60s", _used(planned_steps=44, steps=15, schedule_finished=False, last_lr_share=0.5),
                             True)
    assert spent.endswith("15 of 44 planned steps: resumed with the budget spent, its learning-rate schedule "
                          "unfinished (the last step at 50% of the peak rate)")
    assert not [line for line in (over, ended, spent) if "on time" in line]


def test_the_end_record_is_rank_0s_clock_and_schedule(tmp_path, local_group, monkeypatch):
    plan = {"budget_s": 60.0, "steps": 44, "warmup_steps": 4, "reserve_s": 1.0, "why": "test"}
    cfg = _cfg(tmp_path, time_budget="60s", time_budget_plan=plan, warmup_epochs=2.0).validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    clock = BudgetClock("60s")
    clock.reserve_s = 5.0
    now[0] = 56.0
    assert clock.out_of_time()   # the clock ends the loop: said at the end
    now[0] = 61.2
    used, line = clock.end(run, 15)
    assert line.startswith("time budget 60s: used 61.2 s of 60 s, 1.2 s over budget, 15 of 44 planned steps")
    assert used["used_s"] == 61.2 and used["over_s"] == pytest.approx(1.2) and used["stopped_by_clock"]
    assert not used["schedule_finished"] and used["last_lr_share"] == pytest.approx(
        run.schedule.lr(14) / run.schedule.peak_lr, abs=1e-4) and 0.5 < used["last_lr_share"] < 0.9


def test_a_plan_resumed_at_another_world_size_scales_what_its_workers_share():
    """Measured at 2 workers, resumed at 1: the step, the kNN and the signals take twice as long (each worker embeds
    its share of the images), the checkpoint (rank 0's) as long; the reserve for the end follows."""
    plan = {"budget_s": 45.0, "steps": 40, "warmup_steps": 4, "reserve_s": 9.0, "why": "test", "world_size": 2,
            "measured": {**budget.asdict(COSTS), "signals_s": 2.0}}
    same, said = budget.costs_at(plan, 2)
    assert same == BudgetCosts(**plan["measured"]) and said == ""
    one, said = budget.costs_at(plan, 1)
    assert (one.step_s, one.knn_s, one.signals_s, one.checkpoint_s) == (1.0, 8.0, 4.0, 1.0)
    assert said == "measured at 2 worker(s), scaled to 1"
    cadence = Cadence(steps_per_epoch=100)
    assert budget.reserve_of(one, cadence) == 8.0 + 4.0 + 1.0 + 1.0
    assert budget.costs_at({k: v for k, v in plan.items() if k != "world_size"}, 1)[0] == same   # recorded before


def test_max_steps_given_on_resume_caps_the_plan_and_its_warmup(tmp_path, local_group):
    """A plan of 90 steps resumed with --max-steps 30: a run of 30 steps, its warm-up by the first plan's rule (a
    tenth: 3), as if planned so; a late re-plan's stretch gives way to it. It trained on to the plan's end."""
    plan = {"budget_s": 600.0, "steps": 90, "warmup_steps": 9, "reserve_s": 1.0, "why": "test",
            "stretch": {"knots": [[20, 20.0]], "length": 100}}
    cfg = _cfg(tmp_path, time_budget="10m", time_budget_plan=plan, max_steps=30, warmup_epochs=5.0).validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    assert run.total_steps == run.method.steps_total == 30 and run.schedule.warmup_steps == budget_warmup(30, 5.0, 2)
    assert run.schedule.stretch is None and run.schedule.lr(29) > 0 and run.schedule.lr(30) == 0.0
    line = BudgetClock("10m").start(run, 12, {budget.USED_KEY: 100.0})
    assert "capped at 30 steps by --max-steps 30" in line
    assert cfg.time_budget_plan["steps"] == 30 and cfg.time_budget_plan["warmup_steps"] == 3
    assert "stretch" not in cfg.time_budget_plan and cfg.time_budget_plan["why"].startswith("capped at 30 steps")


def test_a_stop_signal_during_the_measurement_ends_the_run_as_a_preemption(monkeypatch):
    from unison.distributed import signals
    from unison.errors import PREEMPTED_EXIT_CODE, Preempted

    assert budget.stop_if_requested(True) is True and budget.stop_if_requested(False) is False
    monkeypatch.setattr(signals, "_REQUESTS", signals.StopRequests(first=int(budget.signal.SIGTERM), count=1))
    with pytest.raises(Preempted, match=r"preempted by SIGTERM \(received by rank 0\) while the --time-budget run "
                                        r"measured its step, before its first step: nothing was trained") as caught:
        budget.stop_if_requested(True)
    assert caught.value.exit_code == PREEMPTED_EXIT_CODE and caught.value.signal_name == "SIGTERM"

@pytest.mark.parametrize("spent, refused", [(100.0, False), (200.0, True)], ids=["mostly-start-up", "no-room"])
def test_a_budget_that_is_mostly_start_up_names_the_smallest_sensible_one_measured_here(tmp_path, local_group,
                                                                                        monkeypatch, spent, refused):
    """`--preset speedrun --time-budget 2m` on a CPU spent 78.5 s before its first planned step, without a word.
    The start of the run is made to have taken `spent` s of a 2-minute budget (its clock started that much
    earlier): the plan's line warns, or the refusal says, what the start and the end take on this machine and the
    budget that gives the steps half of it, computed from the run's own measurement."""
    from unison.training.budget_advice import duration, sensible_budget_s

    now = [0.0]   # a fake clock: the start took `spent` s; the measurement (faked too) takes none
    monkeypatch.setattr(budget, "clock", lambda: now[0])
    monkeypatch.setattr(budget, "measure_step_s", lambda run, budget_s: (0.05, 5))
    monkeypatch.setattr(budget, "measure_checkpoint_s", lambda run, snapshot: (0.01, 0.5))
    cfg = _cfg(tmp_path, time_budget="2m", method="simclr").validate()
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
    clock = BudgetClock(cfg.time_budget)
    now[0] = spent
    if refused:
        with pytest.raises(ConfigError) as info:
            clock.start(run, 0, {})
        message = str(info.value)
        assert "leaves no time to train" in message and "on this machine the start and the end of a run take" in message
        assert "(half of it for steps)" in message and "\n" not in message
        return
    line = clock.start(run, 0, {})
    plan = cfg.time_budget_plan
    measured = plan["measured"]
    end = final_s(BudgetCosts(**measured), budget.cadence_of(run))
    smallest = duration(sensible_budget_s(measured["spent_s"] + end + measured["step_s"], MARGIN_SHARE))
    assert line is not None and f"; warning: only {plan['steps'] * measured['step_s']:.1f} s of the 120 s" in line
    assert f"the start took {spent:.1f} s" in line and measured["spent_s"] == spent
    assert line.endswith(f"on this machine --time-budget {smallest} or more gives the steps half of it"), line
    assert parse_duration(smallest) > 2 * spent   # more than twice what the start alone took


def test_sensible_budgets_are_written_as_durations_the_option_takes():
    from unison.training.budget_advice import duration, sensible_budget_s, short_budget

    assert [duration(s) for s in (1.2, 95, 119.5, 120, 3601, 7300)] == ["2s", "95s", "2m", "2m", "61m", "3h"]
    assert all(parse_duration(duration(s)) >= s for s in (1.2, 95, 119.5, 120, 3601, 7300))
    assert sensible_budget_s(48.0, 0.02) == pytest.approx(100.0)
    assert short_budget(600.0, 40.0, 8.0, 0.5, 1000, 0.02) is None   # 500 s of 600 for steps: nothing to say
