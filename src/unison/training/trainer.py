"""The trainer: every worker builds one from the run's plan and calls `Trainer.fit`, which reads top to bottom.

    summary = Trainer(plan, device).fit()   # build, restore, the step loop, the end of the run

1. Build (`Trainer._build`): check that every rank runs the same configuration, take this worker's share of the
   cores, join a re-formed torchrun group, then the step (`unison.training.step.build_run`: data, augmentation,
   method, SyncBN, DDP or FSDP, optimizer, schedule; the same step `unison check` proves exact).
2. Restore (`Trainer._restore`): resume from a checkpoint (``--resume``, or by itself when torchrun restarted
   this worker or re-formed its group, or SLURM requeued the job), or measure the random-initialisation kNN
   baseline; a ``--time-budget`` run then measures its step and plans its length (`unison.training.budget`);
   ``config.json`` is written after the restore, so a refused checkpoint leaves the run directory as it was.
3. The step loop (`Trainer._loop`): this rank's micro-batches of a step, the step itself (`train_step`), then the
   work that falls due after it, written in the order it runs: the online probe, logging, the kNN every
   ``--eval-every`` epochs, the label-free signals (which may end the run: ``--stop-on-collapse``), the budget's
   re-plan, a checkpoint (rank 0 writes it in the background), and the ranks' agreement to stop (a preemption
   signal, a failed save, the budget's clock). Hooks given by the caller run last (`unison.training.hooks`).
4. The end (`Trainer._end`): the final kNN and signals, the last checkpoint, ``summary.json``, and the `Summary`
   every rank returns.

Throughout, a heartbeat says which phase each rank is in (`unison.distributed.watchdog`): a run in which no rank
makes progress ends after ``--watchdog-s`` with the ranks and phases named.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.config import TrainConfig
from unison.config.fields import count
from unison.config.train import MIN_COLLAPSE_IMAGES, checkpoint_cadence
from unison.distributed import collectives as C
from unison.distributed.elastic import join_elastic, note_progress, previous_group
from unison.distributed.env import (
    apply_launch_env,
    detect_launch_env,
    init_distributed,
    restart_reason,
    shutdown_distributed,
)
from unison.distributed.signals import install_stop_handlers, restore_default_handlers, stop_requests
from unison.distributed.watchdog import Stuck, Watchdog
from unison.errors import ConfigError, WatchdogTimeout
from unison.eval.knn import knn_accuracy
from unison.paths import is_inside, same_file, write_text_atomic
from unison.training.checkpoint import Checkpointer, latest_checkpoint
from unison.training.checkpoint.files import CHECKPOINT_DIR, step_of
from unison.training.collapse import COLLAPSE_ADVICE, COLLAPSE_EVALS, collapsed
from unison.training.describe import UnreadableImages, describe_backbone, describe_data, describe_init
from unison.training.hooks import StepEnd, TrainHook, hooks_from_env
from unison.training.init_read import init_weights_of
from unison.training.metrics import MetricsLogger, RunLog
from unison.training.preemption import MidStepStop, StopAgreement, preempted, save_failed_elsewhere
from unison.training.resolve import RunPlan, plan_run
from unison.training.run_files import run_file_error
from unison.training.signals import AUTO_EVALUATIONS, AUTO_MIN_EVERY, HeldBack, OnlineProbe, measure_signals
from unison.training.step import (
    Batch,
    Run,
    accumulated_forward_backward,
    batches,
    build_run,
    grouped,
    optimizer_step,
    threads_per_worker,
)
from unison.training.summary import Summary, peak_memory_mib, steady_heap

if TYPE_CHECKING:   # annotations only
    from unison.training.budget import BudgetClock
    from unison.training.pieces import OwnPieces
    from unison.training.profile import ProfileHook
    from unison.training.replan import ReplanHook

__all__ = ["DataWaitWarning", "Trainer", "consistent_config", "knn_top1", "start_line", "train", "train_worker",
           "train_worker_own"]


def train_worker_own(payload: dict[str, Any]) -> dict[str, Any]:
    """`train_worker` of a run given the user's own pieces: ``{"plan": RunPlan, "own": OwnPieces}``."""
    return train_worker(payload["plan"], payload["own"])


def train_worker(plan: RunPlan, own: OwnPieces | None = None) -> dict[str, Any]:
    """Entry point of one worker process (unison's launcher, torchrun, srun or mpirun): its `Summary` as a dict.
    `plan`: the run as the launching process resolved it; `own`: the user's backbone, dataset and transform
    (`unison.training.own`)."""
    install_stop_handlers()   # a SIGTERM during start-up is a stop request too, not a kill
    steady_heap()   # peak memory that does not grow with the data (`unison.training.summary.steady_heap`)
    plan = dataclasses.replace(plan, cfg=copy.deepcopy(plan.cfg))   # this worker's own: the run changes it
    cfg = plan.cfg
    launch_env = detect_launch_env()
    if launch_env is not None:
        cfg.distributed = apply_launch_env(cfg.distributed, launch_env)
    device = init_distributed(cfg.distributed, launch_env.local_rank if launch_env else 0)
    error: BaseException | None = None
    try:
        return train(plan, device, own=own).to_dict()
    except BaseException as exc:
        error = exc
        raise
    finally:
        shutdown_distributed(error)


def train(plan: RunPlan | TrainConfig, device: torch.device, hooks: Sequence[TrainHook] = (), *,
          own: OwnPieces | None = None) -> Summary:
    """Train on this rank (the process group is initialised); every rank returns the same `Summary`.

    `plan`: the run as resolved (a validated `TrainConfig` is planned here: `unison.training.resolve.plan_run`).
    `hooks` run after the trainer's own work, followed by those ``UNISON_TRAIN_HOOKS`` names
    (`unison.training.hooks`). `own`: the user's pieces (`unison.training.own`).
    """
    if isinstance(plan, TrainConfig):
        plan = plan_run(plan, own=own)
    trainer = Trainer(plan, device, hooks)
    try:
        return trainer.fit(own)
    except KeyboardInterrupt:
        trainer.checkpointer.close(abort=True)   # Ctrl-C: end promptly, no half-written checkpoint
        raise
    except Stuck:
        trainer.checkpointer.close(abort=True)   # a save that never returns is not waited for
        raise WatchdogTimeout(str(trainer.watch.stuck)) from None
    finally:
        trainer.checkpointer.close()   # a good save in flight completes (errors elsewhere end the run anyway)
        trainer.watch.close()
        restore_default_handlers()     # in-process runs (world size 1, tests): the caller's handlers again


class Trainer:
    """One rank's run of `plan` (see the module docstring). `hooks`: the caller's, run after the trainer's work."""

    # the state of the work around the steps, set up by `_start_periodic_work`
    run: Run
    runlog: RunLog
    logger: MetricsLogger
    probe: OnlineProbe
    held: HeldBack | None           # the signals' held-back images (None: no signals)
    signals_every: int
    signals_latest: dict[str, float]
    collapse: dict[str, Any] | None
    probe_top1: float | None
    progress: Any                   # the progress bar (rank 0, ``--progress``), else None
    profile: ProfileHook | None
    replan: ReplanHook | None
    t_start: float

    def __init__(self, plan: RunPlan, device: torch.device, hooks: Sequence[TrainHook] = ()) -> None:
        cfg = self.cfg = plan.cfg
        self.plan, self.device, self.master = plan, device, C.rank() == 0
        self.budget: BudgetClock | None = None
        if cfg.time_budget:   # a budgeted run's clock, counting from here (rank 0's); only such a run imports it
            from unison.training.budget import BudgetClock

            self.budget = BudgetClock(cfg.time_budget)
        self.hooks = [*hooks, *hooks_from_env(cfg, C.rank())]
        install_stop_handlers()   # SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (unison.training.preemption)
        # no launcher: the process is the caller's (a notebook's kernel), and a stuck run raises here, not ending it
        self.watch = Watchdog(C.rank(), cfg.distributed.watchdog_s, in_caller=detect_launch_env() is None)
        self.checkpointer = Checkpointer(cfg.out, cfg.keep_checkpoints, asynchronous=cfg.checkpoint_async,
                                         on_write=self._on_checkpoint_write)
        self.history: dict[str, Any] = {}   # what checkpoints carry beside the state: baselines, budget spent, ...

    def fit(self, own: OwnPieces | None = None) -> Summary:
        """Build, restore, train, end (the module docstring's 1 to 4)."""
        with contextlib.ExitStack() as on_exit:   # what a failed run must still close (its metrics file)
            self.run = run = self._build(own)
            self.runlog = RunLog(self.cfg.out, enabled=self.master)
            self.probe = OnlineProbe(run)
            run.extra_state.register("online_probe", self.probe)   # before the restore: a resumed probe continues
            step = self._restore()
            if self.budget is not None:
                self._say(self.budget.start(run, step, self.history))   # measure and plan, or keep the plan
            self._write_config()   # after the restore: a checkpoint refused by it leaves config.json as it was
            self.logger = MetricsLogger(self.cfg.out, enabled=self.master, kind=self.cfg.logger,
                                        config=self.cfg.to_dict(), error=self._file_error)
            on_exit.callback(self.logger.release)
            step = self._loop(step)
            return self._end(step)

    # ---- 1. build

    def _build(self, own: OwnPieces | None) -> Run:
        """Every rank: the same configuration, its share of the cores, the step; rank 0: the run directory."""
        cfg = self.cfg
        consistent_config(cfg)
        torch.set_num_threads(threads_per_worker(cfg, C.world_size()))
        join_elastic(cfg.out, self.device)   # torchrun: a re-formed group of this job resumes like a restart
        resume_after_restart(cfg, Path(cfg.out))   # before the build: a restarted run does not read --init again
        if self.budget is not None:   # resumed by a restart: the checkpoint's plan, not a new measurement
            self.budget.adopt_plan(cfg)
        run = build_run(self.plan, self.device, init=init_weights_of(cfg), own=own)   # the step reads no checkpoint
        if self.master:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            describe_data(run)
            describe_backbone(run)
            describe_init(run)
        return run

    # ---- 2. restore

    def _restore(self) -> int:
        """The steps already done: from ``--resume`` or the run directory after a restart, else 0, with the
        random-initialisation kNN baseline measured (never of a trained encoder)."""
        run, cfg = self.run, self.cfg
        if cfg.resume:
            from unison.training.checkpoint import resume_run

            step, self.history = resume_run(run, cfg.resume)
        else:
            step, self.history = 0, {}
        name_run(run)
        self.runlog.line(start_line(run, C.world_size(), step))
        if "resumed_from_total_steps" in run.resolved:
            self._say(f"the checkpoint's run was planned for {count(run.resolved['resumed_from_total_steps'], 'step')}"
                      f", this one for {run.total_steps} (--epochs/--max-steps): from step {step} the learning rate "
                      "(warm-up, cosine) and the method's schedules follow the new length, as if it had been planned "
                      "so")
        self._say(evaluation_cost(run, step, baseline=step == 0 and cfg.random_init_knn))
        history = self.history
        if step == 0 and cfg.random_init_knn and history.get("random_init_knn_top1") is None:
            with self.watch.phase("eval", step):
                if run.random_backbone is not None:   # --init: the starting point, and the encoder it replaced
                    history["init_knn_top1"] = knn_top1(run)
                started = time.perf_counter()
                history["random_init_knn_top1"] = knn_top1(run, run.random_backbone)
                history["random_init_knn_s"] = time.perf_counter() - started   # a budget plans its end with it
            if history["random_init_knn_top1"] is not None:
                self.runlog.line(f"random-init kNN top-1 {history['random_init_knn_top1']:.4f}")
            if history.get("init_knn_top1") is not None:
                self.runlog.line(f"--init weights kNN top-1 {history['init_knn_top1']:.4f} ({cfg.init})")
        run.random_backbone = None   # measured (or not asked for): its memory is the run's again
        return step

    # ---- 3. the step loop

    def _loop(self, step: int) -> int:
        """The optimiser steps from `step` to the end of the run (or a stop); returns the steps done."""
        run, hooks = self.run, self.hooks
        self._start_periodic_work(step)
        run.method.train()
        for hook in hooks:
            hook.start(run, step)
        spent = self.budget is not None and self.budget.spent_on_resume   # resumed with its budget spent: no steps
        for micro in grouped(self._micro_batches(step, none=spent), run.accumulate):
            for hook in hooks:
                hook.before_step(run, micro[0].step)
            loss, lr = self.train_step(micro)
            step = micro[0].step + 1
            note_progress(step)   # torchrun --nnodes MIN:MAX: how far this group got, for a re-formed one
            end = StepEnd.of(run, step, lr, loss)
            if self.profile is not None:   # first: it records whole iterations, this work included
                self.profile.after_step(run, end)
            self.probe.learn()
            self._log(end)
            if end.step % self.cfg.log_every == 0 or end.epoch_done or end.last:
                self.unreadable.exchange()   # images skipped as unreadable, reported once over the ranks
            if self._evaluation_due(end):
                self._evaluate(end.step, epoch=end.step // run.steps_per_epoch)
            if self.held is not None and not end.last and end.step % self.signals_every == 0:
                self._signals(end)
            if self.budget is not None and self.replan is not None:
                self.budget.keep_spent(self.history)   # a checkpoint (and the run resumed from it) carries it
                self.replan.after_step(run, end)
            if self._checkpoint_due(end):
                end.saved = True
                with self.watch.phase("checkpoint", end.step):
                    self._save(end.step)
                self.last_save = time.monotonic()
            self._agree_to_stop(end)
            for hook in hooks:
                hook.after_step(run, end)
            self.watch.arm()   # start-up (the first step, compile included) is over: the watchdog watches from here
            if end.stop:   # --stop-on-collapse, or the budget's clock: the run ends through its normal end
                break
        for hook in reversed(hooks):
            hook.close()
        self.agreement.close()   # the exchange in flight, before the process group goes away
        self.train_time_s = time.perf_counter() - self.t_start
        if self.progress is not None:
            self.progress.close()
        if self.profile is not None:   # the loop ended before the record did (a stop on time): keep what there is
            self.profile.close()
        return step

    def train_step(self, micro: list[Batch]) -> tuple[torch.Tensor, float]:
        """One optimiser step on this rank's micro-batches of it: (this rank's loss, the learning rate)."""
        loss = accumulated_forward_backward(self.run, micro, self.stop_mid_step)
        return loss, optimizer_step(self.run, micro[0].step)

    def _micro_batches(self, step: int, none: bool = False) -> Iterator[Batch]:
        """This rank's micro-batches from `step` on, made under the watchdog's "data" phase (the caller's hooks
        see each as it arrives); a stop signal between two micro-batches of a step ends the run there."""
        def made() -> Iterator[Batch]:
            for batch in batches(self.run, step) if not none else iter(()):
                self.wait_s += batch.wait_s
                self.wait_since_log += batch.wait_s
                self.probe.see(batch)
                for hook in self.hooks:
                    hook.on_batch(self.run, batch)
                yield batch

        for batch in self.watch.data(made(), step):
            self.stop_mid_step(batch)
            yield batch

    def _start_periodic_work(self, step: int) -> None:
        """The state of the work around the steps: logging, signals, checkpoint timing, the stop agreement, the
        budget's re-plan and the profiler; and the signals of the encoder the loop starts from."""
        run, cfg = self.run, self.cfg
        self.stop_mid_step = MidStepStop(run)
        self.agreement = StopAgreement()   # collective: every rank builds it at the same point
        self.profile, self.replan = None, None   # each imported by the runs that use it
        if cfg.profile_steps:
            from unison.training.profile import ProfileHook

            self.profile = ProfileHook(cfg.out, cfg.profile_steps, C.rank(), self._say)
            self.profile.start(run, step)
        if self.budget is not None:
            from unison.training.replan import ReplanHook

            self.replan = ReplanHook(self.budget, self._say, self._write_config,
                                     untimed=self.profile.records if self.profile is not None else lambda step: False)
            self.replan.start(run, step)
        self.unreadable = UnreadableImages(run, self.runlog)
        self.unreadable.exchange()
        self.cadence = checkpoint_cadence(cfg.checkpoint_every)
        self.last_save = time.monotonic()
        # logging: the first step of an attempt is logged too, so the loss shows from it on
        self.first_step, self.final_loss, self.probe_top1 = step + 1, float("nan"), None
        self.curve: list[tuple[int, float]] = []   # (step, loss) of every logged step, for `Summary.loss_curve`
        self.log_times: list[float] = []
        self.wait_s = self.wait_since_log = self.train_time_s = 0.0
        self.images_since_log = 0
        self.waits = DataWaitWarning(run) if self.master else None
        self.progress = None
        if self.master and cfg.progress:
            from unison.training.progress_bar import progress_bar  # tqdm: for the runs that draw the bar

            self.progress = progress_bar(run.total_steps, step, f"{cfg.method} x{C.world_size()}")
        self.t_start = self.t_log = time.perf_counter()
        # the signals' held-back images; collapse is judged on MIN_COLLAPSE_IMAGES or more (fewer: RankMe stays
        # below its floor even for a healthy network)
        self.held = (HeldBack(run, cfg.signal_images)
                     if cfg.signal_images and run.data.num_images >= 2 and run.data.random_access else None)
        self.signals_every = cfg.signals_every or max(AUTO_MIN_EVERY, math.ceil(run.total_steps / AUTO_EVALUATIONS))
        self.signals_latest: dict[str, float] = {}
        self.collapse_streak, self.collapse, self.stopped_on_collapse, self.signals_s = 0, None, False, 0.0
        self.judges_collapse = self.held is not None and len(self.held) >= MIN_COLLAPSE_IMAGES
        if cfg.stop_on_collapse and not self.judges_collapse:
            why = (f"only {len(self.held)} held-back image(s) (the data has {run.data.num_images})"
                   if self.held is not None else "the data gives no held-back images (it is not indexable, or has "
                   "fewer than 2)")
            self._say(f"warning: --stop-on-collapse is off for this run: {why}, and collapse needs "
                      f"{MIN_COLLAPSE_IMAGES} or more to be judged", log_as_printed=True)
        if step == 0:
            self._measure_signals(0)

    def _log(self, end: StepEnd) -> None:
        """Every ``--log-every`` steps, at the end of each epoch and at the first and last step of an attempt: the
        loss averaged over ranks, the learning rate, images/s and the data-wait share, to the metrics logger,
        ``train.log`` and the progress bar."""
        run, step = self.run, end.step
        self.images_since_log += run.global_batch * run.accumulate
        if step % self.cfg.log_every == 0 or end.last or end.epoch_done or step == self.first_step:
            self.final_loss = float(C.all_reduce_no_grad(end.loss, average=True))
            self.curve.append((step, self.final_loss))
            now = time.perf_counter()
            self.log_times.append(now - self.t_start)
            ips = self.images_since_log / max(now - self.t_log, 1e-9)
            data_wait = min(1.0, self.wait_since_log / max(now - self.t_log, 1e-9))   # this rank's share
            self.t_log, self.images_since_log, self.wait_since_log = now, 0, 0.0
            probe = self.probe.accuracy()
            self.probe_top1 = probe if probe is not None else self.probe_top1
            self.logger.log(step=step, epoch=step / run.steps_per_epoch, loss=self.final_loss, lr=end.lr,
                            images_per_s=ips, data_wait=round(data_wait, 4), probe_top1=probe,
                            world_size=C.world_size())
            if self.progress is not None:   # most important first: a narrow terminal drops the last ones
                bar = {"loss": f"{self.final_loss:.4f}", "img/s": f"{ips:.0f}"}
                if probe is not None:
                    bar["probe"] = f"{probe:.2f}"
                if self.signals_latest:
                    bar.update(RankMe=f"{self.signals_latest['rankme']:.1f}",
                               std=f"{self.signals_latest['emb_std']:.2f}")
                self.progress.show({**bar, "data wait": f"{data_wait:.0%}"})
            shown = f", online probe {probe:.3f}" if probe is not None else ""
            self.runlog.line(f"step {step}/{run.total_steps} (epoch {step / run.steps_per_epoch:.2f}): loss "
                             f"{self.final_loss:.4f}, lr {end.lr:.4g}, {ips:.0f} img/s{shown}")
            if self.waits is not None:
                self.waits.observe(step, data_wait)
        if self.progress is not None:
            self.progress.total = run.total_steps   # a budgeted run plans its length again after its warm-up
            self.progress.update(1)

    def _evaluation_due(self, end: StepEnd) -> bool:
        """kNN every ``--eval-every`` epochs, the last step excepted (the end of the run evaluates it)."""
        every, epoch = self.cfg.eval_every, end.step // self.run.steps_per_epoch
        return bool(end.epoch_done and every and epoch % every == 0 and not end.last and self.run.data.knn)

    def _evaluate(self, step: int, epoch: int | None = None) -> float | None:
        """kNN top-1 of the encoder at `step` (`epoch`: an epoch's periodic evaluation; None: the end's), logged."""
        with self.watch.phase("eval", step):
            acc = knn_top1(self.run)
        self.logger.log(step=step, epoch=float(epoch) if epoch is not None else step / self.run.steps_per_epoch,
                        knn_top1=acc)
        if acc is not None:
            self.runlog.line(f"{'epoch' if epoch is not None else 'step'} "
                             f"{epoch if epoch is not None else step}: kNN top-1 {acc:.4f}")
        return acc

    def _signals(self, end: StepEnd) -> None:
        """The label-free signals at this step; a collapse seen `COLLAPSE_EVALS` times in a row is one warning, and
        with ``--stop-on-collapse`` ends the run here (every rank computed the same values, so every rank stops)."""
        values = self._measure_signals(end.step)
        what = collapsed(values) if self.judges_collapse else None
        self.collapse_streak = self.collapse_streak + 1 if what else 0
        if what and self.collapse_streak >= COLLAPSE_EVALS and self.collapse is None:
            self.collapse = {"step": end.step, "what": what}
            stop = "; --stop-on-collapse: stopping here" if self.cfg.stop_on_collapse else ""
            self._say(f"warning: the representation collapsed by step {end.step} ({what}, {COLLAPSE_EVALS} "
                      f"evaluations in a row){stop}; {COLLAPSE_ADVICE}", log_as_printed=True)
        if self.collapse is not None and self.cfg.stop_on_collapse:
            end.stop = self.stopped_on_collapse = True

    def _measure_signals(self, step: int) -> dict[str, float]:
        """RankMe, embedding std, alignment and uniformity of the held-back images at `step`, logged."""
        if self.held is None:
            return {}
        started = time.perf_counter()
        with self.watch.phase("eval", step):
            values = measure_signals(self.run, self.held, step)
        self.signals_s += time.perf_counter() - started
        self.signals_latest = {**values, "step": step}
        self.logger.log(step=step, epoch=step / self.run.steps_per_epoch,
                        **{k: values[k] for k in ("rankme", "emb_std", "align", "uniform")})
        self.runlog.line(f"step {step}: RankMe {values['rankme']:.1f} of {values['rankme_max']:.0f}, embedding std "
                         f"{values['emb_std']:.3f}/sqrt(d), alignment {values['align']:.3f}, uniformity "
                         f"{values['uniform']:.3f}")
        return values

    def _checkpoint_due(self, end: StepEnd) -> bool:
        """Every ``--checkpoint-every`` steps or seconds, else at the end of every epoch; not the last step (the
        end of the run saves it). A time-based save is decided by rank 0's clock and broadcast (one int per step),
        so every rank saves at the same step."""
        if end.last:
            return False
        if self.cadence.steps:
            return end.step % self.cadence.steps == 0
        if not self.cadence.seconds:
            return end.epoch_done
        due = torch.tensor([int(time.monotonic() - self.last_save >= self.cadence.seconds)], device=self.device)
        return bool(C.broadcast_(due, src=0).item())   # rank 0 decides: every rank joins the same save

    def _agree_to_stop(self, end: StepEnd) -> None:
        """After every step but the last, the ranks agree whether to stop: a preemption signal saves (unless this
        step was just saved) and raises `Preempted`; a failed background save ends the run with its error; the
        budget's clock ends the run through its normal end."""
        if end.last:   # the last step goes on to the final checkpoint anyway
            return
        run, checkpointer, step = self.run, self.checkpointer, end.step
        with self.watch.phase("collective", step):
            decision = self.agreement.exchange(stop_requests(), checkpointer.failed(),
                                               self.budget is not None and self.budget.out_of_time())
        if decision.out_of_time and not decision.stop:   # the budget's end: the normal end of the run follows
            end.stop = True
            return
        if decision.save_failed:
            checkpointer.raise_if_failed()     # rank 0: the save's own error
            raise save_failed_elsewhere()
        if not decision.stop:
            return
        with self.watch.phase("checkpoint", step):
            if not end.saved:
                self._save(step)
            path = checkpointer.wait()         # the preemption checkpoint is complete before anyone exits
            if path is None and self.master:   # --shard full: written by every rank through DCP
                path = latest_checkpoint(checkpointer.run_dir)
            C.barrier()
        raise preempted(decision, step, run.total_steps, str(path) if path is not None else None)

    def _save(self, step: int) -> None:
        """The run's checkpoint at `step`, with its history (`unison.training.checkpoint.run_state`; the first save
        imports the writer's format)."""
        from unison.training.checkpoint import save_run_checkpoint

        save_run_checkpoint(self.run, self.checkpointer, step, self.history)

    def _on_checkpoint_write(self, step: int, written: int) -> None:
        for hook in self.hooks:
            hook.on_checkpoint_write(step, written)

    # ---- 4. the end

    def _end(self, step: int) -> Summary:
        """The final kNN and signals, the last checkpoint, the budget's account and the run's `Summary`."""
        run, history = self.run, self.history
        self.unreadable.final()
        history["knn_top1"] = self._evaluate(step)
        if self.held is not None and self.signals_latest.get("step") != step:
            self._measure_signals(step)
        if self.budget is not None:   # the final kNN counted in the last checkpoint: a resumed run goes on from here
            self.budget.keep_spent(history)
        with self.watch.phase("checkpoint", step):
            self._save(step)
            self.checkpointer.wait()   # complete on disk before the run returns
        note_progress(step, done=True)   # a torchrun job with this id that starts later is a new run
        self.watch.enter("done", step)
        history["signals"] = self._signals_summary()
        if self.budget is not None:
            history["time_budget"], line = self.budget.end(run, step)
            self._say(line)
        return self._summary(step)

    def _signals_summary(self) -> dict[str, Any]:
        """What ``summary.json`` reports of the signals: the last values, the collapse (if any), their time."""
        latest = self.signals_latest
        out: dict[str, Any] = {k: latest[k] for k in ("rankme", "rankme_max", "emb_std", "align", "uniform")
                               if k in latest}
        if self.held is not None:
            out.update(images=len(self.held), every_steps=self.signals_every, eval_s=round(self.signals_s, 3))
        out["collapse"] = self.collapse
        out["stopped_on_collapse"] = self.stopped_on_collapse
        return out

    def _summary(self, step: int) -> Summary:
        """The run's `Summary` (the same on every rank); rank 0 writes ``summary.json`` and closes the metrics."""
        run, cfg, history, train_time = self.run, self.cfg, self.history, self.train_time_s
        summary = Summary(
            method=cfg.method, backbone=run.resolved["backbone"], data=cfg.data, world_size=C.world_size(),
            steps=step, run_id=run.resolved["run_id"], epochs=step / run.steps_per_epoch,
            global_batch=run.global_batch, image_size=run.image_size,
            train_images=run.data.num_images, val_images=run.data.knn.queries.shape[0] if run.data.knn else 0,
            final_loss=self.final_loss, knn_top1=history["knn_top1"],
            random_init_knn_top1=history.get("random_init_knn_top1"), init_knn_top1=history.get("init_knn_top1"),
            train_time_s=train_time, unreadable_images=self.unreadable.total,
            data_wait_fraction=self.wait_s / max(train_time, 1e-9),
            peak_memory_mib=C.all_gather_object(round(peak_memory_mib(self.device), 1)),
            peak_memory_kind="cuda_max_allocated" if self.device.type == "cuda" else "peak_rss", out=str(Path(cfg.out)),
            loss_curve=self.curve, log_times_s=self.log_times, mean=run.resolved["mean"], std=run.resolved["std"],
            signals=history.get("signals", {}), probe_top1=self.probe_top1,
            extra={"checkpoint_wait_s": [round(t, 4) for t in self.checkpointer.wait_s],   # per save, the final last
                   "probe_s": round(self.probe.train_s, 3),   # the online probe's time (in the step loop)
                   **({"time_budget": history["time_budget"]} if history.get("time_budget") else {}),
                   **({"init": run.resolved["init"]} if "init" in run.resolved else {})})   # --init: file, sha256
        if self.master:
            write_text_atomic(Path(cfg.out) / "summary.json", json.dumps(summary.to_json_dict(), indent=2) + "\n",
                              error=self._file_error)
            self.logger.close(random_init_knn_top1=history.get("random_init_knn_top1"),
                              init_knn_top1=history.get("init_knn_top1"))
        return summary

    # ---- shared

    def _write_config(self) -> None:
        """``config.json`` (rank 0): the run's configuration and what it resolved to."""
        if self.master:
            write_text_atomic(Path(self.cfg.out) / "config.json",
                              json.dumps({**self.cfg.to_dict(), "resolved": self.run.resolved}, indent=2) + "\n",
                              error=self._file_error)

    def _file_error(self, path: Path, error: OSError) -> Exception:
        """A failed write of one of the run's own files (a full disk, a read-only folder): one line naming the file
        and the last good checkpoint (`unison.training.run_files`), not an OSError traceback on every rank."""
        return run_file_error(path, error, self.cfg.out)

    def _say(self, line: str | None, log_as_printed: bool = False) -> None:
        """A line on rank 0's standard error and in ``train.log`` (nothing for None); `log_as_printed`: with its
        ``unison:`` prefix there too (the warnings)."""
        if line is None or not self.master:
            return
        print(f"unison: {line}", file=sys.stderr, flush=True)
        self.runlog.line(f"unison: {line}" if log_as_printed else line)


class DataWaitWarning:
    """Warn once when the step waits for data more than `SHARE` of a logging window (the first excepted:
    loader processes are still starting), with what to change."""

    SHARE = 0.25

    def __init__(self, run: Run):
        self.run, self.windows, self.warned = run, 0, False

    def observe(self, step: int, share: float) -> None:
        self.windows += 1
        if self.warned or self.windows == 1 or share <= self.SHARE:
            return
        if self.run.data.mode == "memory" and self.run.device.type == "cuda":
            # The views are made by queued kernels: the host's time making a batch includes its waits for the
            # queue (full of the previous step's kernels), so it does not show that augmentation is slow.
            return
        self.warned = True
        d = self.run.data
        workers = getattr(d.source, "loader_workers", 0)
        advice = (f"raise --loader-workers (now {workers}) or use --decode gpu" if d.mode == "stream" else
                  f"your dataset and transform are the bottleneck: raise loader_workers (now {workers})"
                  if d.mode == "own" else "the in-memory augmentation is the bottleneck (see unison bench)")
        print(f"unison: warning: the training step waited for data {share:.0%} of the time up to step {step} "
              f"(more than {self.SHARE:.0%}); {advice}", file=sys.stderr, flush=True)


def knn_batch(run: Run) -> int:
    """Images per forward pass of the kNN: this rank's share of a training batch, 64 to 512. Why: the no-grad
    activations of a larger pass raise the peak memory above training's own, the more so the larger the
    reference set."""
    return max(64, min(512, run.global_batch // max(1, C.world_size())))


def knn_top1(run: Run, backbone: torch.nn.Module | None = None) -> float | None:
    """Weighted kNN top-1 of the encoder on the run's kNN sets (training images as reference, held-out
    images as queries); None when there are none (`run.data.knn_skipped` says why). `backbone`: embed with this
    one in the method's place (the method's own embedding of it: a ViT method's mean patch token, ...), e.g. the
    random-initialisation encoder of a run started from ``--init`` (`Run.random_backbone`)."""
    knn = run.data.knn
    if knn is None:
        return None
    method = run.method
    was_training = method.training
    method.eval()
    with contextlib.ExitStack() as stack:
        if backbone is not None:
            stack.enter_context(_backbone_swapped(method, backbone.to(run.device).eval()))
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast_dtype is torch.bfloat16):
            acc = knn_accuracy(method.embed, knn.reference, knn.reference_labels, knn.queries, knn.query_labels,
                               run.to_eval, knn.num_classes, k=run.cfg.knn_k, t=run.cfg.knn_t,
                               batch_size=knn_batch(run))
    method.train(was_training)
    return acc


@contextlib.contextmanager
def _backbone_swapped(method: torch.nn.Module, backbone: torch.nn.Module) -> Iterator[None]:
    """`method.backbone` is `backbone` inside the block, its own again after it (also on an error). Why a swap and
    not a second method: the method's embedding (class token, mean patch token, dense features) stays the one
    place that says how the method embeds, and nothing of the method is copied."""
    own = method.backbone
    method.backbone = backbone
    try:
        yield
    finally:
        method.backbone = own


def evaluation_cost(run: Run, step: int, baseline: bool) -> str | None:
    """A line saying what the kNN evaluation will cost when it embeds more images than the run trains on from
    `step` (a smoke run of a few steps on real data: minutes of evaluation), with the flags that skip or bound it;
    None otherwise. `baseline`: the random-initialisation kNN runs too (and, with ``--init``, the kNN of the
    starting weights)."""
    knn, per_epoch, every = run.data.knn, run.steps_per_epoch, run.cfg.eval_every
    if knn is None:
        return None
    during = ((run.total_steps - 1) // per_epoch) // every - (step // per_epoch) // every if every else 0
    baselines = (2 if run.random_backbone is not None else 1) if baseline else 0
    times = baselines + max(0, during) + 1
    reference, queries = len(knn.reference_labels), len(knn.query_labels)
    embedded = times * (reference + queries)
    trained = (run.total_steps - step) * run.global_batch * run.accumulate
    if embedded <= trained:
        return None
    when = ("before training and at the end" if times == 2 and baseline else
            "at the end" if times == 1 else f"{times} times")
    return (f"the kNN evaluation embeds {reference:,} reference and {queries:,} held-out images {when}: "
            f"{embedded:,} images, more than the {trained:,} this run trains on ({count(run.total_steps - step, 'step')}"
            "); --no-knn skips it (a smoke run), --no-random-init-knn only the baseline, --subset/--val-subset make "
            "the sets smaller")


def name_run(run: Run) -> None:
    """``resolved.run_id`` (in every checkpoint, ``config.json`` and ``summary.json``): the resumed checkpoint's when
    the run continues the run of its own directory (``--resume`` naming ``--out`` or a checkpoint in it, a restart),
    a new one otherwise (a fresh run; a run branched from another directory's checkpoint is a run of its own).
    Rank 0 draws it, every rank keeps the same. What tells a run's own checkpoints from one copied in from another
    run (`unison.training.checkpoint.header.check_placement`)."""
    cfg = run.cfg
    resume, out = cfg.resume, Path(cfg.out)
    continues = resume is not None and (same_file(resume, out) or is_inside(resume, out / CHECKPOINT_DIR))
    if continues and isinstance(run.resolved.get("run_id"), str):
        return
    run.resolved["run_id"] = C.broadcast_object(secrets.token_hex(8) if C.rank() == 0 else None)


def consistent_config(cfg: TrainConfig) -> None:
    """Every rank must run the same configuration (rank itself excepted); raise `ConfigError` if not.

    Ranks exchange a SHA-256 digest of the canonical JSON (a few bytes, whatever the config's
    size); only after a mismatch are the configurations gathered, to name what differs.
    """
    d = cfg.to_dict()
    d["distributed"] = {k: v for k, v in d["distributed"].items() if k != "rank"}
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=repr).encode()).hexdigest()
    digests = C.all_gather_object(digest)
    if len(set(digests)) == 1:
        return
    configs = C.all_gather_object(d)  # every rank saw the mismatch, so every rank joins this gather
    bad = next(r for r, x in enumerate(digests) if x != digests[0])

    def flat(x: dict, prefix: str = "") -> dict:
        return {k2: v2 for k, v in x.items()
                for k2, v2 in (flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}

    ref, other = flat(configs[0]), flat(configs[bad])
    diff = [f"{k}: {ref.get(k)!r} vs {other.get(k)!r}" for k in sorted(set(ref) | set(other))
            if ref.get(k) != other.get(k)]
    raise ConfigError(f"rank {bad}'s configuration differs from rank 0's ({'; '.join(diff[:3]) or 'digest'}); "
                      "start every worker with the same options")


def resume_after_restart(cfg: TrainConfig, run_dir: Path) -> None:
    """Restarted by torchrun --max-restarts or requeued by SLURM: continue from the run directory's last checkpoint,
    also when the command names another (a run branched with ``--resume X.pt --out DIR`` goes on from DIR's latest,
    not from X again), unless DIR holds nothing as recent as that checkpoint."""
    if restart_reason() is None:
        return
    latest = latest_checkpoint(run_dir) if C.rank() == 0 else None   # rank 0 decides, every rank follows
    if latest is not None and cfg.resume and not same_file(cfg.resume, run_dir):
        from unison.training.checkpoint import read_header

        latest = latest if step_of(latest) >= read_header(cfg.resume).step else None
    chosen = C.all_gather_object(None if latest is None else str(latest))[0]
    if chosen is None:
        return
    cfg.resume = str(run_dir)
    if C.rank() == 0:
        message = f"unison: {restart_reason()}: resuming from {chosen}"
        before = previous_group()
        if before is not None and before.world_size != C.world_size():   # torchrun --nnodes MIN:MAX
            message = (f"unison: workers {before.world_size} -> {C.world_size()} at step {before.step}: "
                       f"resuming from {Path(chosen).name}")
        print(message, file=sys.stderr, flush=True)
        RunLog(run_dir).line(message)


def start_line(run: Run, world: int, step: int) -> str:
    """The first ``train.log`` line of a run (or of a resumed attempt): what runs, and the values it resolved to."""
    r, cfg = run.resolved, run.cfg
    where = f"resuming at step {step}" if step else "starting"
    backbone = cfg.backbone if r["backbone"] == cfg.backbone else f"{cfg.backbone} ({r['backbone']})"   # vit_*_auto
    planning = cfg.time_budget is not None and cfg.time_budget_plan is None   # the plan comes after this line
    length = f"the steps that fit --time-budget {cfg.time_budget}" if planning else count(run.total_steps, 'step')
    return (f"{cfg.method} x{count(world, 'worker')} on {cfg.data}, {where}: {length} "
            f"({run.steps_per_epoch} per epoch), global batch {run.global_batch}, {backbone} at {run.image_size} "
            f"px, {r['optimizer']} peak lr {r['peak_lr']:.4g}, weight decay {r['weight_decay']:g}, augmentation "
            f"{r['augmentation']}; run dir {cfg.out}")
