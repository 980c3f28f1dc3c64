"""``--time-budget`` with real worker processes: 2 ranks whose clocks disagree train one plan (rank 0's), a run whose
steps turn slower than measured re-plans, late too (its schedules then end at its new last step), a run slower still
after its last check is ended by the clock, through its normal end, and a resumed run keeps its plan (resumed with
--resume, at another world size, or restarted by torchrun with the original command) unless --max-steps caps it. A
stop signal during the measurement ends the run there, as a preemption."""

from __future__ import annotations

import json

import budget_hooks
import pytest

from unison.cli import main
from unison.errors import PREEMPTED_EXIT_CODE
from unison.training.step import budget_warmup

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BUDGET_S = 120.0   # as rank 0's budget clock counts it: the slow steps below cost no wall time
TINY = ["--batch-size", "32", "--subset", "512", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--signal-images", "0", "--no-online-probe", "--log-every", "1", "--world-size", "2"]


def test_ranks_agree_on_the_plan_and_the_run_ends_on_time(tmp_path, monkeypatch):
    """Rank 1's clock runs 50x fast: alone it would plan ~50x fewer steps (or none); rank 0 decides for both.
    Rank 0's budget clock counts every step as 4x the step measured before the run (`budget_hooks`: set by the
    test, whatever the step really took, so the machine's load cannot move the plans): the first check, once five
    steps are timed inside the warm-up, re-plans fewer steps from step 0 (its warm-up never shorter than the steps
    trained on it), and every rank trains them. After it the steps take 3x longer again: the next
    check re-plans fewer steps again, and the schedules go on from where they were to end at its last step. After
    the last check they take 4x longer again: the clock, not the plan, ends the run, and the result line says that
    the schedule did not finish. Resumed on one worker, the reserve for the end is scaled to it. (Real sleeps, and then
    slowdowns in proportion to the real step, were undone by the load: a re-plan planned more steps, not fewer,
    and a run slower than its re-plan ran out of budget before its late check.)"""
    budget_hooks.register(monkeypatch, "skew=50,plan=4,replan=3,late=4")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--time-budget", f"{BUDGET_S:g}s", "--out", str(out)]) == 0
    ranks = [json.loads((out / f"budget-rank{r}.json").read_text()) for r in (0, 1)]
    plan = json.loads((out / "config.json").read_text())["time_budget_plan"]
    assert plan["steps"] > 1 and f"fit {BUDGET_S:g} s" in plan["why"] and plan["measured"]["step_s"] > 0
    replanned = plan["replanned"]   # the steps were 4x slower than measured: fewer of them fit
    assert replanned["first_steps"] > plan["late"][0]["steps_before"]
    assert replanned["step_s"] > 1.5 * plan["measured"]["step_s"], plan
    late = plan["late"][0]   # 3x slower again: fewer steps, the schedules laid onto what was left of them
    at = replanned["after_step"]   # the first check, inside the warm-up: the warm-up covers the steps trained
    assert plan["warmup_steps"] >= at and late["after_step"] > plan["warmup_steps"], plan
    assert (f"re-planned after step {at} from {at - 1} trained steps of {replanned['step_s']:.4g} s: "
            f"{late['steps_before']} steps, {plan['warmup_steps']} of them warm-up") in (out / "train.log").read_text()
    # (a later late check may plan a step more or less: what it sees is the load, not a change of step time)
    after_late = plan["late"][1]["steps_before"] if len(plan["late"]) > 1 else plan["steps"]
    assert late["steps_before"] > after_late and late["step_s"] > 1.5 * replanned["step_s"], plan
    assert plan["stretch"]["knots"][0][0] == late["after_step"] and plan["stretch"]["length"] == late["steps_before"]
    for r in ranks:   # one plan: the schedules of every rank end at its last step, and they stopped together
        assert r["plan_steps"] == r["total_steps"] == plan["steps"] and r["steps_total"] == plan["stretch"]["length"]
        assert r["steps"] == ranks[0]["steps"]
    used = json.loads((out / "summary.json").read_text())["extra"]["time_budget"]
    assert used["planned_steps"] == plan["steps"] and used["steps"] == ranks[0]["steps"]
    assert used["stopped_by_clock"] and used["steps"] < plan["steps"], used
    # the end (kNN, checkpoint) was planned for: the run overruns by at most the step that crossed the line, the
    # one in flight while the ranks agreed to stop, and what the load adds
    assert used["used_s"] <= BUDGET_S + 2 * ranks[0]["longest_step_s"] + 10, (used, ranks)   # rank 0's clock
    log = (out / "train.log").read_text()
    assert f"time budget {BUDGET_S:g}s: used" in log and "on time" not in log
    assert (f"{used['steps']} of {plan['steps']} planned steps: the steps ran slower than planned and the clock ended "
            "the run, its learning-rate schedule unfinished") in log

    # resumed: the plan is kept, not measured again, and only what is left of the budget is spent: none here,
    # so not a step more (the stop exchange would act after the first step's start-up and one more)
    monkeypatch.delenv("UNISON_TEST_BUDGET")
    assert main(["train", "--resume", str(out), "--no-progress", "--world-size", "1"]) == 0
    log = (out / "train.log").read_text()
    assert f"resuming the plan of {plan['steps']} steps at step {used['steps']}" in log
    assert "the reserve for the end (final kNN, signals, checkpoint, one step) measured at 2 worker(s), scaled to 1" in log
    assert "nothing is left for steps" in log and ": resumed with the budget spent, its learning-rate schedule" in log
    again = json.loads((out / "summary.json").read_text())["extra"]["time_budget"]
    assert again["steps"] == used["steps"] and again["used_s"] > used["used_s"], again
    assert json.loads((out / "config.json").read_text())["time_budget_plan"] == plan
    assert log.count(": planned ") == 1   # measured and planned once

    # restarted by torchrun (or requeued by SLURM): the original command again, without --resume or the plan in it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(["train", *TINY, "--time-budget", f"{BUDGET_S:g}s", "--out", str(out)]) == 0
    log = (out / "train.log").read_text()
    assert log.count(": planned ") == 1 and log.count(f"resuming the plan of {plan['steps']} steps") == 2
    assert json.loads((out / "config.json").read_text())["time_budget_plan"] == plan


def test_a_stop_during_the_measurement_ends_the_run_within_a_step(tmp_path, monkeypatch, capfd):
    """SIGTERM to rank 1 in its second measurement step: every rank stops after that step, exit 75, before any plan
    (it was acted on after the measurement, the plan and two steps; a plan that then found no time exited 2)."""
    budget_hooks.register(monkeypatch, "term=2")
    out = tmp_path / "run"
    capfd.readouterr()
    code = main(["train", *TINY, "--no-random-init-knn", "--time-budget", "10m", "--out", str(out)])
    err = capfd.readouterr().err
    assert code == PREEMPTED_EXIT_CODE, err
    assert [json.loads((out / f"measured-rank{r}.json").read_text())["steps"] for r in (0, 1)] == [2, 2]
    assert ("preempted by SIGTERM (received by rank 1) while the --time-budget run measured its step, before its "
            "first step: nothing was trained") in err and "Traceback" not in err
    assert not list(out.glob("checkpoints/*")) and "planned" not in (out / "train.log").read_text()


def test_max_steps_given_on_resume_caps_the_plan(tmp_path):
    """A budgeted run planned for 9 steps, resumed from its step 2 with --max-steps 3: it trains to step 3, not 9
    ("9 of 3 planned steps"), and records the capped plan."""
    out, branch = tmp_path / "run", tmp_path / "branch"
    one = [*TINY[:-1], "1"]   # --world-size 1: in this process
    assert main(["train", *one, "--time-budget", "1h", "--max-steps", "9", "--checkpoint-every", "1",
                 "--keep-checkpoints", "9", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["time_budget_plan"]["steps"] == 9
    assert main(["train", "--resume", str(out / "checkpoints" / "step_00000002.pt"), "--max-steps", "3", "--out",
                 str(branch), "--no-progress"]) == 0
    used = json.loads((branch / "summary.json").read_text())["extra"]["time_budget"]
    assert (used["steps"], used["planned_steps"], used["schedule_finished"]) == (3, 3, True)
    plan = json.loads((branch / "config.json").read_text())["time_budget_plan"]
    assert plan["steps"] == 3 and plan["warmup_steps"] == budget_warmup(3, 2.0, 16) == 0   # at most a tenth
    log = (branch / "train.log").read_text()
    assert "capped at 3 steps by --max-steps 3" in log and "used" in log and "3 of 3 planned steps" in log
