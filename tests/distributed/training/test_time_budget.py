"""``--time-budget`` with real worker processes: 2 ranks whose clocks disagree train one plan (rank 0's), a run whose
steps turn slower than measured re-plans, late too (its schedules then end at its new last step), a run slower still
after its last check is ended on time by the clock, through its normal end, and a resumed run keeps its plan
(resumed with --resume, or restarted by torchrun with the original command)."""

from __future__ import annotations

import json

import budget_hooks
import pytest

from unison.cli import main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BUDGET_S = 120.0   # as rank 0's budget clock counts it: the slow steps below cost no wall time
TINY = ["--batch-size", "32", "--subset", "512", "--val-subset", "64", "--knn-k", "5", "--no-progress",
        "--signal-images", "0", "--no-online-probe", "--log-every", "1", "--world-size", "2"]


def test_ranks_agree_on_the_plan_and_the_run_ends_on_time(tmp_path, monkeypatch):
    """Rank 1's clock runs 50x fast: alone it would plan ~50x fewer steps (or none); rank 0 decides for both.
    Rank 0's budget clock counts every step as 4x the step measured before the run (`budget_hooks`: set by the
    test, whatever the step really took, so the machine's load cannot move the plans): the re-plan after the
    warm-up plans fewer steps, and every rank trains them. After it the steps take 3x longer again: the first late
    re-plan takes fewer steps again, and the schedules go on from where they were to end at its last step. After
    the last late check they take 4x longer again: the clock, not the plan, ends the run. (Real sleeps, and then
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
    assert f"re-planned after step {replanned['after_step']}" in (out / "train.log").read_text()
    late = plan["late"][0]   # 3x slower again: fewer steps, the schedules laid onto what was left of them
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
    assert f"time budget {BUDGET_S:g}s: used" in (out / "train.log").read_text()

    # resumed: the plan is kept, not measured again, and only what is left of the budget is spent: none here,
    # so not a step more (the stop exchange would act after the first step's start-up and one more)
    monkeypatch.delenv("UNISON_TEST_BUDGET")
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    log = (out / "train.log").read_text()
    assert f"resuming the plan of {plan['steps']} steps at step {used['steps']}" in log
    assert "nothing is left for steps" in log and "(resumed with the budget spent)" in log
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
