"""``--time-budget``: the steps that fit a wall-clock budget, planned once, kept on resume, ended on time.

1. Measure (`measure_costs`, every rank, before the step loop of a new run): a few warm-up steps (compile,
   allocator, loader start), then steady steps timed between device synchronisations; the kNN's embedding rate on
   one batch of its images; the copy and the write of a checkpoint of this model and optimizer. The measured
   steps are then undone (`Snapshot`: weights, buffers, optimizer state, extra state, RNG), so the run trains
   from step 0 exactly as a ``--max-steps`` run of the planned length would.
2. Plan (`plan_steps`, a pure function, on rank 0): the largest step count N such that the time spent so far,
   N steps, the periodic work of N steps (epoch checkpoints, ``--eval-every`` kNN, the label-free signals), the
   final kNN, signals and checkpoint, one step of stop delay and a safety margin fit the budget; the warm-up is
   ``--warmup-epochs`` but at most a tenth of N (`budget_warmup`). Rank 0 broadcasts the plan, so every rank
   trains the same N even when their clocks disagree.
3. Apply: the plan goes into ``cfg.time_budget_plan`` (``config.json`` and every checkpoint record it, with the
   measured costs: why N) and `unison.training.step.apply_plan` plans the learning rate and every schedule of
   the method for N steps, the one rule `build_run` and a resumed run use. A resumed run reads the plan from
   its checkpoint's configuration and does not measure again.
4. Stop on time (`BudgetClock`): rank 0's clock says when the step loop must end to leave room for the final
   work; the ranks agree through the per-step stop exchange (`unison.training.preemption`), so a run slower
   than measured still ends on time, through its normal end. The budget used is reported at the end and kept
   in the history, so a resumed run spends only what is left.
5. Plan again (`unison.training.replan`): at the end of the warm-up, from the steps the run has trained, and late
   (half and four fifths of the way), from the steps since, the schedules then going on from where they are.

The budget counts from the start of `unison.training.trainer.Trainer` on rank 0 (after the workers' start-up): data,
model build, the random-initialisation kNN, the measurement, training and the final kNN and checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import tempfile
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from unison.config.budget import check_plan, parse_duration
from unison.config.train import checkpoint_cadence
from unison.distributed import collectives as C
from unison.errors import ConfigError
from unison.training.checkpoint import read_header
from unison.training.checkpoint.rng_state import pack_rng_state, restore_rng_state
from unison.training.signals import AUTO_EVALUATIONS, AUTO_MIN_EVERY, PROBE_IMAGES, OnlineProbe
from unison.training.step import Batch, Run, accumulated_forward_backward, apply_plan, batches, grouped, optimizer_step

clock = time.perf_counter   # one clock for the whole module (the 2-rank test skews it on one rank)
WARMUP_MEASURE_STEPS = 3     # not timed: compile, first allocations, loader start
TIMED_STEPS = (5, 30)        # at least / at most, timed until MIN_TIMED_S has passed
MIN_TIMED_S = 1.0
MEASURE_SHARE = 0.05         # the measurement stops early past this share of the budget (two timed steps at least)
MARGIN_SHARE = 0.02          # kept free of the plan: clocks, logging, the variation of the step time
WARMUP_SHARE_MAX = 0.1       # the warm-up of a budgeted run is at most this share of its steps
USED_KEY = "time_budget_used_s"   # in the run's history (checkpointed): the budget spent by earlier attempts


@dataclass(frozen=True)
class BudgetCosts:
    """What the plan is made from, in seconds (all measured on this run, rank 0's values)."""

    spent_s: float              # the budget spent when the plan is made (start-up, data, measurement)
    step_s: float               # one steady optimiser step, with the online probe's share
    knn_s: float                # one kNN evaluation (0: the run has none)
    signals_s: float            # one measurement of the label-free signals (0: none)
    checkpoint_copy_s: float    # what the step loop waits for at a periodic (background) checkpoint
    checkpoint_s: float         # the final checkpoint, written before the run returns


@dataclass(frozen=True)
class Cadence:
    """How often the periodic work of the run happens (from its configuration)."""

    steps_per_epoch: int
    eval_every: int = 0          # kNN every N epochs (0: only at the end)
    checkpoint_every: int = 0    # steps (0: every epoch, unless checkpoint_every_s)
    signals_every: int = 0       # steps (0: automatic, `unison.training.signals`)
    signals: bool = True
    checkpoint_every_s: float = 0.0   # --checkpoint-every 10m: one save per that much training time

    def periodic_s(self, steps: int, costs: BudgetCosts) -> float:
        """The time the periodic work of a `steps`-step run takes, the final work excluded."""
        epochs = steps // self.steps_per_epoch
        if self.checkpoint_every_s:
            saves = int(steps * costs.step_s / self.checkpoint_every_s)
        else:
            saves = (steps - 1) // self.checkpoint_every if self.checkpoint_every else max(0, epochs - (
                steps % self.steps_per_epoch == 0))
        evals = (epochs - (steps % self.steps_per_epoch == 0)) // self.eval_every if self.eval_every else 0
        every = self.signals_every or max(AUTO_MIN_EVERY, math.ceil(steps / AUTO_EVALUATIONS))
        signals = (1 + (steps - 1) // every) if self.signals else 0   # the start's and the periodic ones
        return saves * costs.checkpoint_copy_s + max(0, evals) * costs.knn_s + signals * costs.signals_s


def final_s(costs: BudgetCosts, cadence: Cadence) -> float:
    """The end of the run after its last step: kNN, signals, the checkpoint written in full."""
    return costs.knn_s + (costs.signals_s if cadence.signals else 0.0) + costs.checkpoint_s


def plan_steps(budget_s: float, costs: BudgetCosts, cadence: Cadence, cap: int | None = None) -> int:
    """The most steps N for which the budget holds the time spent, N steps and their periodic work, one step of
    stop delay, the final work and a margin of `MARGIN_SHARE`; 0 when not even one fits. `cap`: ``--max-steps``."""
    room = budget_s * (1 - MARGIN_SHARE) - costs.spent_s - final_s(costs, cadence) - costs.step_s

    def fits(n: int) -> bool:
        return n * costs.step_s + cadence.periodic_s(n, costs) <= room

    hi = int(max(0.0, room) / max(costs.step_s, 1e-9)) + 1
    if cap is not None:
        hi = min(hi, cap)
    lo = 0
    while lo < hi:   # the time grows with N: the last N that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def budget_warmup(steps: int, warmup_epochs: float, steps_per_epoch: int) -> int:
    """The warm-up of a budgeted run: ``--warmup-epochs``, at most `WARMUP_SHARE_MAX` of its steps."""
    if steps <= 1:
        return 0
    return min(int(warmup_epochs * steps_per_epoch), int(WARMUP_SHARE_MAX * steps), steps - 1)


def cadence_of(run: Run) -> Cadence:
    cfg, saves = run.cfg, checkpoint_cadence(run.cfg.checkpoint_every)
    return Cadence(run.steps_per_epoch, cfg.eval_every if run.data.knn is not None else 0, saves.steps,
                   cfg.signals_every, cfg.signal_images > 0 and run.data.random_access, checkpoint_every_s=saves.seconds)


class BudgetClock:
    """Rank 0's clock of a budgeted run: started with `unison.training.trainer.Trainer`; `spent_before_s` is what
    earlier attempts of a resumed run spent (its history)."""

    def __init__(self, budget: str) -> None:
        self.budget_s = parse_duration(budget)
        self.started = clock()
        self.spent_before_s = 0.0
        self.reserve_s = 0.0   # kept for the end of the run (`final_s`), set by the plan
        self.planned_here = False   # this attempt measured and planned (`unison.training.replan` may plan again)
        self.spent_on_resume = False   # a resumed attempt found it spent (every rank): it trains no more steps

    def spent_s(self) -> float:
        return self.spent_before_s + clock() - self.started

    def out_of_time(self) -> bool:
        """Whether the step loop must end now (rank 0 decides; the other ranks' clocks are not read)."""
        return C.rank() == 0 and self.spent_s() >= self.budget_s - self.reserve_s


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
    steps than that (``--max-steps``) takes them again from step 0: it used to time its first steps, which compile
    with ``--compile`` (a 2-step run timed 72 s steps on a loaded 2-core CPU and found no time left to train)."""
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
            continue
        timed += 1
        sync_device(run)
        elapsed = clock() - timed_from
        enough = timed >= TIMED_STEPS[1] or (timed >= TIMED_STEPS[0] and elapsed >= MIN_TIMED_S) or (
            timed >= 2 and clock() - started >= MEASURE_SHARE * budget_s)
        if C.broadcast_object(enough if C.rank() == 0 else None):
            break
    elapsed = C.broadcast_object(elapsed)   # rank 0's: every rank returns the figure rank 0 plans with
    return elapsed / max(1, timed), timed


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
    plan = describe_plan(budget.budget_s, costs, cadence_of(run), cfg, timed) if C.rank() == 0 else None
    plan = C.broadcast_object(plan)
    if plan["steps"] < 1:
        raise ConfigError(f"--time-budget {cfg.time_budget} leaves no time to train: {plan['why']}; give a longer "
                          "budget")
    cfg.time_budget_plan = plan
    apply_plan(run)
    budget.reserve_s, budget.planned_here = plan["reserve_s"], True
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
            "reserve_s": final + costs.step_s, "why": why,
            "measured": {k: round(v, 6) for k, v in asdict(costs).items()}}


def adopt_plan(cfg: Any) -> None:
    """A budgeted run resumed from a checkpoint whose configuration did not come with the command (a torchrun
    restart or SLURM requeue of the original command, ``train(cfg)`` with ``cfg.resume``): the checkpoint's plan,
    before the run is built, so that its schedules are planned for it from the start."""
    if cfg.time_budget is None or cfg.time_budget_plan is not None or not cfg.resume:
        return
    plan = read_header(cfg.resume).config.get("time_budget_plan")
    if plan is not None:
        check_plan(plan, cfg.time_budget)
        cfg.time_budget_plan = plan


def start_budget(run: Run, budget: BudgetClock | None, step: int, history: dict[str, Any]) -> str | None:
    """Before the step loop: a new budgeted run measures and plans; a resumed one keeps its plan and what it has
    spent. Returns the line for ``train.log`` (None without a budget)."""
    if budget is None:
        return None
    plan = run.cfg.time_budget_plan
    if plan is None:
        if step:
            raise ConfigError("--time-budget was not given when this run started, so it has no plan to resume; "
                              "resume without --time-budget (or start a new run directory with it)")
        plan = plan_budget(run, budget, history.get("random_init_knn_s"))
        return f"time budget {run.cfg.time_budget}: planned {plan['steps']} steps: {plan['why']}"
    budget.spent_before_s = float(history.get(USED_KEY, 0.0))
    budget.reserve_s = float(plan.get("reserve_s", 0.0))
    # decided before the loop: the per-step stop exchange would act a step late, after the first step's start-up
    budget.spent_on_resume = bool(C.broadcast_object(budget.out_of_time() if C.rank() == 0 else None))
    return (f"time budget {run.cfg.time_budget}: resuming the plan of {plan['steps']} steps at step {step}, "
            f"{budget.spent_before_s:.1f} s of {budget.budget_s:g} s spent before"
            + ("; nothing is left for steps: the run goes on to its end" if budget.spent_on_resume else ""))


def end_budget(run: Run, budget: BudgetClock | None, step: int) -> dict[str, Any] | None:
    """After the final checkpoint: the budget used (rank 0's clock, broadcast) and whether the loop ended early."""
    if budget is None:
        return None
    used = C.broadcast_object(budget.spent_s() if C.rank() == 0 else None)
    planned = run.total_steps
    return {"budget_s": budget.budget_s, "used_s": round(used, 3), "planned_steps": planned, "steps": step,
            "stopped_by_clock": step < planned}


def used_line(budget: str, used: dict[str, Any], spent_on_resume: bool) -> str:
    """The line for ``train.log`` at the end of a budgeted run (`used`: `end_budget`'s record)."""
    why = (" (resumed with the budget spent)" if spent_on_resume else
           " (the steps ran slower than measured: ended on time)" if used["stopped_by_clock"] else "")
    return (f"time budget {budget}: used {used['used_s']:.1f} s of {used['budget_s']:g} s, "
            f"{used['steps']} of {used['planned_steps']} planned steps{why}")
