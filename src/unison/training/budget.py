"""``--time-budget``: the steps that fit a wall-clock budget, planned, checked as they run, kept on resume.

1. Measure (`plan_budget`, every rank, before the step loop of a new run): a few warm-up steps (compile,
   allocator, loader start), then steady steps timed between device synchronisations; the kNN's embedding rate on
   one batch of its images; the copy and the write of a checkpoint of this model and optimizer. The measured
   steps are then undone (`Snapshot`: weights, buffers, optimizer state, extra state, RNG), so the run trains
   from step 0 exactly as a ``--max-steps`` run of the planned length would. A stop signal during the
   measurement ends the run after the step it arrived in (`stop_if_requested`): exit 75, before any plan.
2. Plan (`plan_steps`, a pure function, on rank 0): the largest step count N such that the time spent so far,
   N steps, the periodic work of N steps (epoch checkpoints, ``--eval-every`` kNN, the label-free signals), the
   final kNN, signals and checkpoint, one step of stop delay and a safety margin fit the budget; the warm-up is
   ``--warmup-epochs`` but at most a tenth of N (`budget_warmup`). Rank 0 broadcasts the plan, so every rank
   trains the same N even when their clocks disagree.
3. Apply: the plan goes into ``cfg.time_budget_plan`` (``config.json`` and every checkpoint record it, with the
   measured costs and the world size they were measured at: why N) and `unison.training.step.apply_plan` plans
   the learning rate and every schedule of the method for N steps, the one rule `build_run` and a resumed run
   use (`unison.training.step.plan_length`, which a ``--max-steps`` given on resume caps). A resumed run reads
   the plan from its checkpoint's configuration and does not measure again; at another world size the reserve
   for its end is scaled to it (`costs_at`).
4. Stop in time (`BudgetClock`): rank 0's clock says when the step loop must end to leave room for the final
   work; the ranks agree through the per-step stop exchange (`unison.training.preemption`), so a run slower
   than measured still ends through its normal end. The budget used is reported at the end (`used_line`: an
   overrun and an unfinished schedule are said as such) and kept in the history, so a resumed run spends only
   what is left.
5. Plan again (`unison.training.replan`): the run checks its plan against the steps it trains, at the end of the
   warm-up and then every tenth of the plan, and plans again by `plan_steps` when they run far from it.

The budget counts from the start of `unison.training.trainer.Trainer` on rank 0 (after the workers' start-up): data,
model build, the random-initialisation kNN, the measurement, training and the final kNN and checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import signal
import tempfile
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict
from typing import Any

import torch

from unison.config.budget import check_plan, parse_duration
from unison.config.train import checkpoint_cadence
from unison.distributed import collectives as C
from unison.distributed.signals import stop_requests
from unison.errors import ConfigError, Preempted
from unison.training.budget_advice import short_budget, too_short
from unison.training.budget_plan import MARGIN_SHARE, BudgetCosts, Cadence, costs_at, final_s, plan_steps, reserve_of
from unison.training.checkpoint import read_header
from unison.training.checkpoint.rng_state import pack_rng_state, restore_rng_state
from unison.training.signals import PROBE_IMAGES, OnlineProbe
from unison.training.step import (
    Batch,
    Run,
    accumulated_forward_backward,
    apply_plan,
    batches,
    budget_warmup,
    grouped,
    optimizer_step,
)

clock = time.perf_counter   # one clock for the whole module (the 2-rank test skews it on one rank)
WARMUP_MEASURE_STEPS = 3     # not timed: compile, first allocations, loader start
TIMED_STEPS = (5, 30)        # at least / at most, timed until MIN_TIMED_S has passed
MIN_TIMED_S = 1.0
MEASURE_SHARE = 0.05         # the measurement stops early past this share of the budget (two timed steps at least)
USED_KEY = "time_budget_used_s"   # in the run's history (checkpointed): the budget spent by earlier attempts


def cadence_of(run: Run) -> Cadence:
    cfg, saves = run.cfg, checkpoint_cadence(run.cfg.checkpoint_every)
    return Cadence(run.steps_per_epoch, cfg.eval_every if run.data.knn is not None else 0, saves.steps,
                   cfg.signals_every, cfg.signal_images > 0 and run.data.random_access, checkpoint_every_s=saves.seconds)


class BudgetClock:
    """Rank 0's clock of a budgeted run: started with `unison.training.trainer.Trainer`; `spent_before_s` is what
    earlier attempts of a resumed run spent (its history). The trainer's whole budget: its plan taken from a
    restarted run's checkpoint (`adopt_plan`), measured and planned or resumed (`start`), the end of the step loop
    (`out_of_time`), the budget spent kept in the history (`keep_spent`) and the account at the end (`end`)."""

    def __init__(self, budget: str) -> None:
        self.budget_s = parse_duration(budget)
        self.started = clock()
        self.spent_before_s = 0.0
        self.reserve_s = 0.0   # kept for the end of the run (`final_s`), set by the plan
        self.spent_on_resume = False   # a resumed attempt found it spent (every rank): it trains no more steps
        self.ended_by_clock = False    # rank 0's clock said the step loop must end (`out_of_time`)

    def spent_s(self) -> float:
        return self.spent_before_s + clock() - self.started

    def out_of_time(self) -> bool:
        """Whether the step loop must end now (rank 0 decides; the other ranks' clocks are not read)."""
        if C.rank() == 0 and self.spent_s() >= self.budget_s - self.reserve_s:
            self.ended_by_clock = True
        return self.ended_by_clock

    def adopt_plan(self, cfg: Any) -> None:
        """A budgeted run resumed from a checkpoint whose configuration did not come with the command (a torchrun
        restart or SLURM requeue of the original command, ``train(cfg)`` with ``cfg.resume``): the checkpoint's plan,
        before the run is built, so that its schedules are planned for it from the start."""
        if cfg.time_budget is None or cfg.time_budget_plan is not None or not cfg.resume:
            return
        plan = read_header(cfg.resume).config.get("time_budget_plan")
        if plan is not None:
            check_plan(plan, cfg.time_budget)
            cfg.time_budget_plan = plan

    def start(self, run: Run, step: int, history: dict[str, Any]) -> str:
        """Before the step loop: a new budgeted run measures and plans; a resumed one keeps its plan and what it has
        spent. Returns the line for ``train.log``."""
        plan = run.cfg.time_budget_plan
        if plan is None:
            if step:
                raise ConfigError("--time-budget was not given when this run started, so it has no plan to resume; "
                                  "resume without --time-budget (or start a new run directory with it)")
            plan = plan_budget(run, self, history.get("random_init_knn_s"))
            short = short_budget(plan["budget_s"], *_fixed(plan, cadence_of(run)), plan["steps"], MARGIN_SHARE)
            return (f"time budget {run.cfg.time_budget}: planned {plan['steps']} steps: {plan['why']}"
                    + (f"; warning: {short}" if short else ""))
        self.spent_before_s = float(history.get(USED_KEY, 0.0))
        notes = []
        if "measured" in plan:   # the end's reserve as this attempt will spend it (its world size)
            costs, scaled = costs_at(plan, C.world_size())
            self.reserve_s = reserve_of(costs, cadence_of(run))
            if scaled:
                notes.append(f"the reserve for the end (final kNN, signals, checkpoint, one step) {scaled}: "
                             f"{self.reserve_s:.1f} s (was {float(plan['reserve_s']):.1f} s)")
        else:
            self.reserve_s = float(plan.get("reserve_s", 0.0))
        if run.total_steps < int(plan["steps"]):   # --max-steps given on resume caps the plan (`plan_length`)
            notes.append(f"capped at {run.total_steps} steps by --max-steps {run.cfg.max_steps}")
            run.cfg.time_budget_plan = {**{k: v for k, v in plan.items() if k != "stretch"}, "steps": run.total_steps,
                                        "warmup_steps": run.schedule.warmup_steps,
                                        "why": f"capped at {run.total_steps} steps by --max-steps on resume; {plan['why']}"}
        # decided before the loop: the per-step stop exchange would act a step late, after the first step's start-up
        self.spent_on_resume = bool(C.broadcast_object(self.out_of_time() if C.rank() == 0 else None))
        if self.spent_on_resume:
            notes.append("nothing is left for steps: the run goes on to its end")
        return (f"time budget {run.cfg.time_budget}: resuming the plan of {plan['steps']} steps at step {step}, "
                f"{self.spent_before_s:.1f} s of {self.budget_s:g} s spent before" + "".join(f"; {n}" for n in notes))

    def keep_spent(self, history: dict[str, Any]) -> None:
        """The budget spent so far into the run's `history` (`USED_KEY`): a checkpoint, and the run resumed from it,
        carries it."""
        history[USED_KEY] = self.spent_s()

    def end(self, run: Run, step: int) -> tuple[dict[str, Any], str]:
        """After the final checkpoint: the budget used (rank 0's clock, broadcast), whether rank 0's clock ended the
        loop, and where the learning rate stands when the schedule did not reach its end; and the result line that
        says it (`used_line`)."""
        used, by_clock = C.broadcast_object((self.spent_s(), self.ended_by_clock) if C.rank() == 0 else None)
        planned = run.total_steps
        record = {"budget_s": self.budget_s, "used_s": round(used, 3), "planned_steps": planned, "steps": step,
                  "stopped_by_clock": bool(by_clock) and step < planned, "over_s": round(max(0.0, used - self.budget_s), 3),
                  "schedule_finished": step >= planned}
        if step < planned:   # the rate of its last step, as a share of the peak
            record["last_lr_share"] = round(run.schedule.lr(max(0, step - 1)) / max(run.schedule.peak_lr, 1e-30), 4)
        return record, used_line(str(run.cfg.time_budget), record, self.spent_on_resume)


class Snapshot:
    """The state a step changes (weights, buffers, optimizer state, extra state, this rank's RNG), taken before
    the measurement steps and put back after them: the run then starts from step 0 as if never measured."""

    def __init__(self, run: Run) -> None:
        self.model = {k: v.detach().clone() for k, v in run.method.state_dict().items()}
        self.extra = run.extra_state.collect() if run.extra_state.names() else None   # collective: every rank
        self.rng = pack_rng_state()

    def restore(self, run: Run) -> None:
        run.method.load_state_dict(self.model)
        inner = getattr(run.optimizer, "_optimizer", None)   # ZeRO-1: the wrapped optimizer (and its local one)
        for optimizer in (run.optimizer, inner, getattr(inner, "optim", None)):
            state = getattr(optimizer, "state", None)
            if isinstance(state, dict):
                state.clear()   # a fresh optimizer's state: momentum buffers and step counters made at the first step
        run.optimizer.zero_grad(set_to_none=True)
        if self.extra is not None:
            run.extra_state.restore(copy.deepcopy(self.extra))
        restore_rng_state(self.rng)


def sync_device(run: Run) -> None:
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)


def measure_step_s(run: Run, budget_s: float) -> tuple[float, int]:
    """(seconds per steady step, steps timed): `WARMUP_MEASURE_STEPS` untimed steps, then timed ones until rank 0
    says enough (`TIMED_STEPS`, `MIN_TIMED_S`, `MEASURE_SHARE`); every rank takes the same steps. A run with fewer
    steps than that (``--max-steps``) takes them again from step 0, never times its first steps: with ``--compile``
    they compile, and a plan from them would find no time left to train."""
    with contextlib.closing(_steps_round_again(run)) as steps:
        return _timed_steps(run, steps, budget_s, WARMUP_MEASURE_STEPS)


def _steps_round_again(run: Run) -> Generator[list[Batch], None, None]:
    """The run's optimiser steps from step 0, and again from step 0 when they run out; each pass's data closed
    when it ends or the measurement does (streamed data's loaders end with it)."""
    while True:
        steps = grouped(batches(run, 0), run.accumulate)
        taken = 0
        try:
            for step in steps:
                taken += 1
                yield step
        finally:
            steps.close()
        if not taken:   # a run of no steps: nothing to time
            return


def _timed_steps(run: Run, steps: Iterator[list[Batch]], budget_s: float, warmup: int) -> tuple[float, int]:
    started = clock()
    timed_from, taken, timed, elapsed = started, 0, 0, 0.0
    for micro in steps:
        accumulated_forward_backward(run, micro)
        optimizer_step(run, micro[0].step)
        taken += 1
        if taken <= warmup:
            if taken == warmup:
                sync_device(run)
                timed_from = clock()
            stop_if_requested(False)
            continue
        timed += 1
        sync_device(run)
        elapsed = clock() - timed_from
        enough = timed >= TIMED_STEPS[1] or (timed >= TIMED_STEPS[0] and elapsed >= MIN_TIMED_S) or (
            timed >= 2 and clock() - started >= MEASURE_SHARE * budget_s)
        if stop_if_requested(enough):
            break
    elapsed = C.broadcast_object(elapsed)   # rank 0's: every rank returns the figure rank 0 plans with
    return elapsed / max(1, timed), timed


def stop_if_requested(enough: bool = False) -> bool:
    """After each measurement step, every rank: rank 0's `enough` (whether the step is timed well enough), and a
    stop signal (SIGTERM, SIGUSR1) received by any rank ends the run here, on every rank, as a preemption (exit
    75): the measurement would otherwise run on, and the plan after it, before the step loop's stop exchange
    hears the signal (a cluster kills the job some seconds after it)."""
    votes = C.all_gather_object((bool(enough) if C.rank() == 0 else False, stop_requests().first))
    stopped = next(((r, sig) for r, (_, sig) in enumerate(votes) if sig), None)
    if stopped is not None:
        name = signal.Signals(stopped[1]).name
        raise Preempted(f"preempted by {name} (received by rank {stopped[0]}) while the --time-budget run measured "
                        "its step, before its first step: nothing was trained, so there is no checkpoint to keep; "
                        "run the same command again (it measures again)", signal_name=name)
    return bool(votes[0][0])


def measure_eval_s(run: Run) -> float:
    """Seconds to embed one image for the kNN and the signals (this rank's share, forward only), from one batch
    of the kNN's reference images (else training images), after one untimed batch."""
    knn = run.data.knn
    images = knn.reference if knn is not None and isinstance(knn.reference, torch.Tensor) else run.train_set
    images = getattr(images, "images", images)
    if not isinstance(images, torch.Tensor) or images.shape[0] == 0:
        return 0.0
    chunk = images[: max(1, min(256, run.global_batch // max(1, C.world_size())))].to(run.device)
    was_training = run.method.training
    run.method.eval()
    with torch.no_grad():
        run.method.embed(run.to_eval(chunk))
        sync_device(run)
        started = clock()
        run.method.embed(run.to_eval(chunk))
        sync_device(run)
    run.method.train(was_training)
    return (clock() - started) / chunk.shape[0]


def measure_checkpoint_s(run: Run, snapshot: Snapshot) -> tuple[float, float]:
    """(copy, write) seconds of this run's checkpoint, measured by copying the model state to the CPU and writing
    it with the optimizer state's size again (momentum, Adam moments) to a file in the run directory (rank 0)."""
    started = clock()
    cpu = {k: getattr(v, "to_local", lambda v=v: v)().to("cpu", copy=True) for k, v in snapshot.model.items()}
    copy_s = clock() - started
    model_bytes = sum(t.numel() * t.element_size() for t in cpu.values())
    optim_bytes = sum(v.numel() * v.element_size() for s in run.optimizer.state.values() if isinstance(s, dict)
                      for v in s.values() if isinstance(v, torch.Tensor))
    if C.rank() != 0:   # rank 0 writes the checkpoints (and decides the plan)
        return copy_s, copy_s
    started = clock()
    buffer = io.BytesIO()
    torch.save({"model": cpu, "optimizer": torch.empty(optim_bytes, dtype=torch.uint8)}, buffer)
    with tempfile.NamedTemporaryFile(dir=run.cfg.out, prefix=".budget-", suffix=".tmp") as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    write_s = clock() - started
    return copy_s * (1 + optim_bytes / max(model_bytes, 1)), copy_s + write_s


def plan_budget(run: Run, budget: BudgetClock, knn_s: float | None = None) -> dict[str, Any]:
    """Measure, undo the measured steps, plan on rank 0, broadcast, apply (the module docstring's 1 to 3).
    `knn_s`: the time of the random-initialisation kNN, when the run measured it (the final kNN's twin)."""
    cfg = run.cfg
    snapshot = Snapshot(run)
    step_s, timed = measure_step_s(run, budget.budget_s)
    copy_s, checkpoint_s = measure_checkpoint_s(run, snapshot)
    snapshot.restore(run)
    knn, world = run.data.knn, max(1, C.world_size())
    knn_images = knn.reference.shape[0] + knn.queries.shape[0] if knn is not None else 0
    per_image_s = knn_s / max(1.0, knn_images / world) if knn_s else measure_eval_s(run)
    probe = OnlineProbe(run)   # the online probe embeds a few images of every step, outside the step itself
    probe_s = per_image_s * min(PROBE_IMAGES, run.global_batch) / world if probe.enabled else 0.0
    costs = BudgetCosts(spent_s=budget.spent_s(), step_s=step_s + probe_s,
                        knn_s=knn_s or per_image_s * knn_images / world,
                        signals_s=3 * cfg.signal_images * per_image_s / world, checkpoint_copy_s=copy_s,
                        checkpoint_s=checkpoint_s)
    stop_if_requested()   # a stop during the rest of the measurement (kNN rate, checkpoint write): before the plan
    plan = describe_plan(budget.budget_s, costs, cadence_of(run), cfg, timed) if C.rank() == 0 else None
    plan = C.broadcast_object(plan)
    if plan["steps"] < 1:
        raise ConfigError(f"--time-budget {cfg.time_budget} leaves no time to train: {plan['why']}; "
                          f"{too_short(*_fixed(plan, cadence_of(run)), MARGIN_SHARE)}")
    cfg.time_budget_plan = plan
    apply_plan(run)
    budget.reserve_s = plan["reserve_s"]
    return plan


def describe_plan(budget_s: float, costs: BudgetCosts, cadence: Cadence, cfg: Any, timed: int) -> dict[str, Any]:
    """The plan as ``config.json`` records it: the steps, the warm-up, the reserve for the end, and why."""
    steps = plan_steps(budget_s, costs, cadence, cfg.max_steps)
    final = final_s(costs, cadence)
    why = (f"{steps} steps of {costs.step_s:.4g} s (timed over {timed} steps after {WARMUP_MEASURE_STEPS} warm-up "
           f"steps) fit {budget_s:g} s: {costs.spent_s:.1f} s spent before the plan (start-up, data, measurement), "
           f"{cadence.periodic_s(steps, costs):.1f} s for periodic checkpoints, kNN and signals, {final:.1f} s for "
           f"the final kNN, signals and checkpoint, {MARGIN_SHARE:.0%} margin"
           + (f"; capped by --max-steps {cfg.max_steps}" if cfg.max_steps and steps == cfg.max_steps else ""))
    return {"budget_s": budget_s, "steps": steps,
            "warmup_steps": budget_warmup(steps, cfg.warmup_epochs, cadence.steps_per_epoch),
            "reserve_s": reserve_of(costs, cadence), "why": why, "world_size": C.world_size(),
            "measured": {k: round(v, 6) for k, v in asdict(costs).items()}}


def _fixed(plan: dict[str, Any], cadence: Cadence) -> tuple[float, float, float]:
    """(start, end, step) seconds of rank 0's measured costs in `plan`: what `unison.training.budget_advice` says
    a short budget goes to."""
    costs = BudgetCosts(**plan["measured"])
    return costs.spent_s, final_s(costs, cadence), costs.step_s


def over_text(over_s: float) -> str:
    """An overrun in seconds for the result line: never rounded to nothing."""
    return f"{over_s:.1f} s" if over_s >= 0.1 else "less than 0.1 s"


def used_line(budget: str, used: dict[str, Any], spent_on_resume: bool) -> str:
    """The result line of a budgeted run (`used`: `BudgetClock.end`'s record): every figure on it as measured, an
    overrun said as one, and a schedule that did not reach its end said with where its learning rate stands."""
    line = (f"time budget {budget}: used {used['used_s']:.1f} s of {used['budget_s']:g} s"
            + (f", {over_text(used['over_s'])} over budget" if used["over_s"] > 0 else "")
            + f", {used['steps']} of {used['planned_steps']} planned steps")
    if used["schedule_finished"]:
        return line + (" (resumed with the budget spent)" if spent_on_resume else "")
    why = ("resumed with the budget spent" if spent_on_resume else
           "the steps ran slower than planned and the clock ended the run" if used["stopped_by_clock"] else
           "the run ended before its last step")
    return (line + f": {why}, its learning-rate schedule unfinished (the last step at "
            f"{used['last_lr_share']:.0%} of the peak rate)")
