"""The training loop: every worker runs `train_worker`, and `_train` reads top to bottom.

1. Build: join the process group (unison's launcher, torchrun, SLURM or mpirun set the variables),
   check that every rank runs the same configuration, build the step (`unison.training.step.build_run`:
   data, augmentation, method, SyncBN, DDP or FSDP, optimizer, schedule; the same step `unison check`
   proves exact).
2. Restore: resume from a checkpoint (``--resume``, or by itself when torchrun restarted this worker or
   re-formed its group at another size, `unison.distributed.elastic`, or SLURM requeued the job), or record
   the random-initialisation kNN baseline; then write ``config.json`` (after the restore, so that a refused
   checkpoint leaves the run directory as it was).
3. The step loop: once this rank's micro-batches of a step are in, `accumulated_forward_backward` (exact
   accumulation over them, or a loss per micro-batch: `unison.training.step`) and `optimizer_step`, then the
   hooks, in this order: the online probe, logging, kNN evaluation, the label-free signals
   (`unison.training.signals`: they may end the run, ``--stop-on-collapse``), checkpoint timing (rank 0 writes,
   in the background: `Checkpointer`), the stop agreement (preemption signals, a failed save)
   (`unison.training.loop_hooks`); then any extra hooks (`unison.training.hooks`: ``train(..., hooks=...)`` or
   ``UNISON_TRAIN_HOOKS``, which the fault-injection tests use).
4. The end: kNN evaluation, the signals, the last checkpoint, ``summary.json``, and the `Summary` returned to
   the caller (rank 0's is what `unison.train` returns).

Throughout, a heartbeat says which phase each rank is in (`unison.distributed.watchdog`), so a
run in which no rank makes progress ends after ``--watchdog-s`` with the ranks and phases named.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.config import TrainConfig
from unison.config.fields import count
from unison.distributed import collectives as C
from unison.distributed.elastic import join_elastic, note_progress, previous_group
from unison.distributed.env import (
    apply_launch_env,
    detect_launch_env,
    init_distributed,
    restart_reason,
    shutdown_distributed,
)
from unison.distributed.signals import install_stop_handlers, restore_default_handlers
from unison.distributed.watchdog import Stuck, Watchdog
from unison.errors import ConfigError, WatchdogTimeout
from unison.paths import is_inside, same_file, write_text_atomic
from unison.training.budget import USED_KEY, BudgetClock, BudgetHook, adopt_plan, end_budget, start_budget, used_line
from unison.training.checkpoint import Checkpointer, latest_checkpoint, read_header, resume_run
from unison.training.checkpoint.files import CHECKPOINT_DIR, step_of
from unison.training.describe import describe_backbone, describe_data, describe_init
from unison.training.hooks import Hooks, StepEnd, TrainHook, hooks_from_env
from unison.training.init_read import init_weights_of
from unison.training.loop_hooks import (
    CheckpointHook,
    DataWaitWarning,
    KnnEvalHook,
    LogHook,
    StopHook,
    UnreadableImagesHook,
    evaluation_cost,
    knn_top1,
)
from unison.training.metrics import MetricsLogger
from unison.training.preemption import MidStepStop
from unison.training.profile import ProfileHook
from unison.training.replan import ReplanHook
from unison.training.run_files import run_file_error
from unison.training.runlog import RunLog
from unison.training.signals import ProbeHook, SignalsHook
from unison.training.step import (
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
    from unison.training.pieces import OwnPieces

__all__ = ["DataWaitWarning", "consistent_config", "knn_top1", "start_line", "train", "train_worker", "train_worker_own"]


def train_worker_own(payload: dict[str, Any]) -> dict[str, Any]:
    """`train_worker` of a run given the user's own pieces: ``{"config": cfg.to_dict(), "own": OwnPieces}``."""
    return train_worker(payload["config"], payload["own"])


def train_worker(payload: dict[str, Any], own: OwnPieces | None = None) -> dict[str, Any]:
    """Entry point of one worker process (unison's launcher, torchrun, srun or mpirun): its `Summary` as a dict.
    `own`: the user's backbone, dataset and transform (`unison.training.own`)."""
    install_stop_handlers()   # a SIGTERM during start-up is a stop request too, not a kill
    steady_heap()   # peak memory that does not grow with the data (`unison.training.summary.steady_heap`)
    cfg = TrainConfig.from_dict(payload)
    launch_env = detect_launch_env()
    if launch_env is not None:
        cfg.distributed = apply_launch_env(cfg.distributed, launch_env)
    device = init_distributed(cfg.distributed, launch_env.local_rank if launch_env else 0)
    error: BaseException | None = None
    try:
        return train(cfg, device, own=own).to_dict()
    except BaseException as exc:
        error = exc
        raise
    finally:
        shutdown_distributed(error)


def train(cfg: TrainConfig, device: torch.device, hooks: Sequence[TrainHook] = (), *,
          own: OwnPieces | None = None) -> Summary:
    """Train on this rank (the process group is initialised); every rank returns the same `Summary`.

    `hooks` run after the loop's own, followed by those ``UNISON_TRAIN_HOOKS`` names (`unison.training.hooks`).
    `own`: the user's pieces (`unison.training.own`).
    """
    budget = BudgetClock(cfg.time_budget) if cfg.time_budget else None   # counts from here (rank 0's clock)
    extra = Hooks([*hooks, *hooks_from_env(cfg, C.rank())])
    install_stop_handlers()    # SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (unison.training.preemption)
    # no launcher: the process is the caller's (a notebook's kernel), and a stuck run raises here instead of ending it
    watch = Watchdog(C.rank(), cfg.distributed.watchdog_s, in_caller=detect_launch_env() is None)
    checkpointer = Checkpointer(cfg.out, cfg.keep_checkpoints, asynchronous=cfg.checkpoint_async,
                                on_write=extra.on_checkpoint_write)
    try:
        with contextlib.ExitStack() as on_exit:   # what a failed run must still close (its metrics file)
            return _train(cfg, device, watch, extra, checkpointer, on_exit, own, budget)
    except KeyboardInterrupt:
        checkpointer.close(abort=True)     # Ctrl-C: end promptly, no half-written checkpoint
        raise
    except Stuck:
        checkpointer.close(abort=True)     # a save that never returns is not waited for
        raise WatchdogTimeout(str(watch.stuck)) from None
    finally:
        checkpointer.close()               # a good save in flight completes (errors elsewhere end the run anyway)
        watch.close()
        restore_default_handlers()         # in-process runs (world size 1, tests): the caller's handlers again


def _train(cfg: TrainConfig, device: torch.device, watch: Watchdog, extra: Hooks, checkpointer: Checkpointer,
           on_exit: contextlib.ExitStack, own: OwnPieces | None = None, budget: BudgetClock | None = None) -> Summary:
    """Build, restore, the step loop with its hooks, the end of the run (the module docstring's 1 to 4)."""
    # ---- build the step, restore a checkpoint (or record the random-initialisation baseline)
    run = _build(cfg, device, own)
    runlog = RunLog(cfg.out, enabled=C.rank() == 0)
    probe = ProbeHook(run)
    run.extra_state.register("online_probe", probe)   # before the restore: a resumed run's probe continues
    step, history = _restore(run, watch, runlog)
    _say(start_budget(run, budget, step, history), runlog)   # --time-budget: measure and plan, or keep the plan
    # after the restore: a checkpoint refused by it leaves the run directory's config as it was
    _write_config(run)
    logger = MetricsLogger(cfg.out, enabled=C.rank() == 0, kind=cfg.logger, config=cfg.to_dict(),
                           error=lambda path, e: run_file_error(path, e, cfg.out))
    on_exit.callback(logger.release)

    # ---- the hooks, in the order they run after every step
    signals = SignalsHook(run, watch, logger, runlog)
    log = LogHook(run, logger, runlog, step, probe=probe, signals=signals)
    unreadable = UnreadableImagesHook(run, runlog)
    knn = KnnEvalHook(run, watch, logger, runlog)
    saver = CheckpointHook(run, checkpointer, watch, history)
    stop = StopHook(run, checkpointer, watch, history, budget.out_of_time if budget else lambda: False)
    profile = [ProfileHook(cfg.out, cfg.profile_steps, C.rank(), lambda line: _say(line, runlog))
               ] if cfg.profile_steps else []   # first: it records whole iterations, the other hooks' work included
    spent = [BudgetHook(budget, history), ReplanHook(budget, lambda line: _say(line, runlog), lambda: _write_config(run),
                                                     untimed=profile[0].records if profile else lambda step: False)
             ] if budget else []
    hooks = Hooks([*profile, probe, log, unreadable, knn, signals, *spent, saver, stop, *extra.hooks])

    # ---- the loop
    run.method.train()
    hooks.start(run, step)
    # heartbeat: "data" while a batch is made; a step's micro-batches all at once (exact accumulation needs them)
    stop_mid_step = MidStepStop(run)
    spent_on_resume = budget is not None and budget.spent_on_resume   # resumed with its budget spent: no steps
    for micro in grouped(stop_mid_step.gather(watch.data(hooks.batches(run, iter(()) if spent_on_resume else
                                                                       batches(run, step)), step)), run.accumulate):
        hooks.before_step(run, micro[0].step)
        loss = accumulated_forward_backward(run, micro, stop_mid_step)
        lr = optimizer_step(run, micro[0].step)
        step = micro[0].step + 1
        note_progress(step)   # torchrun --nnodes MIN:MAX: how far this group got, for a re-formed one
        end = StepEnd.of(run, step, lr, loss)
        hooks.after_step(run, end)
        watch.arm()   # start-up (the first step, compile included) is over: the watchdog watches from here
        if end.stop:   # --stop-on-collapse: the run ends here, through the normal end below
            break
    hooks.close()

    # ---- the end: evaluation, last checkpoint, summary
    unreadable.final()
    knn.final(step, history)
    signals.final(step)
    if budget is not None:   # the final kNN counted in the last checkpoint: a resumed run goes on from here
        history[USED_KEY] = budget.spent_s()
    saver.final(step)
    note_progress(step, done=True)   # a torchrun job with this id that starts later is a new run
    watch.enter("done", step)
    history["signals"] = signals.summary()
    history["time_budget"] = used = end_budget(run, budget, step)
    if budget is not None and used is not None:
        _say(used_line(str(cfg.time_budget), used, budget.spent_on_resume), runlog)
    return _summary(run, step, history, log, checkpointer, logger, probe.train_s, unreadable.total)


def _write_config(run: Run) -> None:
    """``config.json`` (rank 0): the run's configuration and what it resolved to; a full disk or a read-only folder
    is one line naming the file and the last good checkpoint (`unison.training.run_files`), not an OSError
    traceback on every rank."""
    if C.rank() == 0:
        write_text_atomic(Path(run.cfg.out) / "config.json",
                          json.dumps({**run.cfg.to_dict(), "resolved": run.resolved}, indent=2) + "\n",
                          error=lambda path, e: run_file_error(path, e, run.cfg.out))


def _build(cfg: TrainConfig, device: torch.device, own: OwnPieces | None = None) -> Run:
    """Every rank: the same configuration, its share of the cores, the step; rank 0: the run directory."""
    consistent_config(cfg)
    torch.set_num_threads(threads_per_worker(cfg, C.world_size()))
    join_elastic(cfg.out, device)   # torchrun: a re-formed group of this job (another size) resumes like a restart
    _resume_after_restart(cfg, Path(cfg.out))   # before the build: a restarted run does not read --init again
    adopt_plan(cfg)   # a budgeted run resumed by a restart: the checkpoint's plan, not a new measurement
    run = build_run(cfg, device, init=init_weights_of(cfg), own=own)   # --init read here: the step cannot read checkpoints
    if C.rank() == 0:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        describe_data(run)
        describe_backbone(run)
        describe_init(run)
    return run


def _say(line: str | None, runlog: RunLog) -> None:
    """A line on rank 0's standard error and in ``train.log`` (nothing for None)."""
    if line is not None and C.rank() == 0:
        print(f"unison: {line}", file=sys.stderr, flush=True)
        runlog.line(line)


def _restore(run: Run, watch: Watchdog, runlog: RunLog) -> tuple[int, dict[str, Any]]:
    """(steps done, history): from ``--resume`` or the run directory after a restart, else (0, {}) and the
    random-initialisation kNN baseline (never of a trained encoder: with ``--init``, of the encoder the run would
    have started from without it, and the starting weights' kNN beside it, ``init_knn_top1``)."""
    cfg = run.cfg
    step, history = resume_run(run, cfg.resume) if cfg.resume else (0, {})
    name_run(run)
    runlog.line(start_line(run, C.world_size(), step))
    if "resumed_from_total_steps" in run.resolved and C.rank() == 0:
        replanned = (f"unison: the checkpoint's run was planned for "
                     f"{count(run.resolved['resumed_from_total_steps'], 'step')}, "
                     f"this one for {run.total_steps} (--epochs/--max-steps): from step {step} the learning rate "
                     "(warm-up, cosine) and the method's schedules follow the new length, as if it had been planned so")
        print(replanned, file=sys.stderr, flush=True)
        runlog.line(replanned)
    note = evaluation_cost(run, step, baseline=step == 0 and cfg.random_init_knn)
    if note and C.rank() == 0:
        print(f"unison: {note}", file=sys.stderr, flush=True)
        runlog.line(note)
    if step == 0 and cfg.random_init_knn and history.get("random_init_knn_top1") is None:
        with watch.phase("eval", step):
            if run.random_backbone is not None:   # --init: the starting point, and the encoder it replaced
                history["init_knn_top1"] = knn_top1(run)
            started = time.perf_counter()
            history["random_init_knn_top1"] = knn_top1(run, run.random_backbone)
            history["random_init_knn_s"] = time.perf_counter() - started   # what a --time-budget plans the end with
        if history["random_init_knn_top1"] is not None:
            runlog.line(f"random-init kNN top-1 {history['random_init_knn_top1']:.4f}")
        if history.get("init_knn_top1") is not None:
            runlog.line(f"--init weights kNN top-1 {history['init_knn_top1']:.4f} ({cfg.init})")
    run.random_backbone = None   # measured (or not asked for): its memory is the run's again
    return step, history


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


def _summary(run: Run, step: int, history: dict[str, Any], log: LogHook, checkpointer: Checkpointer,
             logger: MetricsLogger, probe_s: float = 0.0, unreadable_images: int = 0) -> Summary:
    """The run's `Summary` (the same on every rank); rank 0 writes ``summary.json`` and closes the metrics."""
    cfg, device, train_time = run.cfg, run.device, log.train_time_s
    summary = Summary(
        method=cfg.method, backbone=run.resolved["backbone"], data=cfg.data, world_size=C.world_size(), steps=step,
        run_id=run.resolved["run_id"],
        epochs=step / run.steps_per_epoch, global_batch=run.global_batch, image_size=run.image_size,
        train_images=run.data.num_images, val_images=run.data.knn.queries.shape[0] if run.data.knn else 0,
        final_loss=log.final_loss, knn_top1=history["knn_top1"],
        random_init_knn_top1=history.get("random_init_knn_top1"), init_knn_top1=history.get("init_knn_top1"),
        train_time_s=train_time,
        data_wait_fraction=log.wait_s / max(train_time, 1e-9),
        peak_memory_mib=C.all_gather_object(round(peak_memory_mib(device), 1)),
        peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "peak_rss", out=str(Path(cfg.out)),
        loss_curve=log.curve, log_times_s=log.log_times, mean=run.resolved["mean"], std=run.resolved["std"],
        signals=history.get("signals", {}), probe_top1=log.probe_top1, unreadable_images=unreadable_images,
        extra={"checkpoint_wait_s": [round(t, 4) for t in checkpointer.wait_s],   # per save, the final one last
               "probe_s": round(probe_s, 3),   # the online probe's time (in the step loop)
               **({"time_budget": history["time_budget"]} if history.get("time_budget") else {}),
               **({"init": run.resolved["init"]} if "init" in run.resolved else {})})   # --init: file, sha256
    if C.rank() == 0:
        write_text_atomic(Path(cfg.out) / "summary.json", json.dumps(summary.to_json_dict(), indent=2) + "\n",
                          error=lambda path, e: run_file_error(path, e, cfg.out))
        logger.close(random_init_knn_top1=history.get("random_init_knn_top1"),
                     init_knn_top1=history.get("init_knn_top1"))
    return summary


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


def _resume_after_restart(cfg: TrainConfig, run_dir: Path) -> None:
    """Restarted by torchrun --max-restarts or requeued by SLURM: continue from the run directory's last checkpoint,
    also when the command names another (a run branched with ``--resume X.pt --out DIR`` goes on from DIR's latest,
    not from X again), unless DIR holds nothing as recent as that checkpoint."""
    if restart_reason() is None:
        return
    latest = latest_checkpoint(run_dir) if C.rank() == 0 else None   # rank 0 decides, every rank follows
    if latest is not None and cfg.resume and not same_file(cfg.resume, run_dir):
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
