"""The training loop: every worker runs `train_worker`, top to bottom.

1. Join the process group (unison's launcher, torchrun, SLURM or mpirun set the variables).
2. Build the step (`unison.training.step.build_run`): data, augmentation, method, SyncBN, DDP,
   optimizer, schedule — the same step `unison check` proves exact.
3. Resume from a checkpoint (``--resume``, or by itself when torchrun restarted this worker or
   SLURM requeued the job), or record the random-initialisation kNN baseline.
4. For each of this rank's micro-batches: `forward_backward`; after the last one of a step,
   `optimizer_step`. Around the step, the hooks: metrics and progress, kNN evaluation every
   few epochs, checkpoints (rank 0 writes, in the background: `Checkpointer`; sharded optimizer
   state consolidated first; `Run.extra_state` carried), and the stop agreement (preemption
   signals, a failed save: `unison.training.preemption`).
5. At the end: kNN evaluation, the last checkpoint, `summary.json`, and the `Summary`
   returned to the caller (rank 0's is what `unison.train` returns).

Throughout, a heartbeat says which phase each rank is in (`unison.distributed.watchdog`), so a
run in which no rank makes progress ends after ``--watchdog-s`` with the ranks and phases named.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from unison.config import TrainConfig
from unison.distributed import collectives as C
from unison.distributed.env import (
    apply_launch_env,
    detect_launch_env,
    init_distributed,
    restart_reason,
    shutdown_distributed,
)
from unison.distributed.signals import install_stop_handlers, restore_default_handlers, stop_requests
from unison.distributed.watchdog import Watchdog
from unison.errors import ConfigError
from unison.eval.knn import knn_accuracy
from unison.training.checkpoint import Checkpointer, latest_checkpoint, resume_run, save_run_checkpoint
from unison.training.faults import FaultHook
from unison.training.metrics import MetricsLogger, progress_bar
from unison.training.preemption import StopAgreement, preempted, save_failed_elsewhere
from unison.training.runlog import RunLog
from unison.training.step import Run, batches, build_run, forward_backward, optimizer_step, threads_per_worker
from unison.training.summary import Summary, peak_memory_mib


def train_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """Entry point of one worker process (unison's launcher, torchrun, srun or mpirun): its `Summary` as a dict."""
    install_stop_handlers()   # a SIGTERM during start-up is a stop request too, not a kill
    cfg = TrainConfig.from_dict(payload)
    launch_env = detect_launch_env()
    if launch_env is not None:
        cfg.distributed = apply_launch_env(cfg.distributed, launch_env)
    device = init_distributed(cfg.distributed, launch_env.local_rank if launch_env else 0)
    try:
        return train(cfg, device).to_dict()
    finally:
        shutdown_distributed()


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


def knn_top1(run: Run) -> float | None:
    """Weighted kNN top-1 of the encoder on the run's kNN sets (training images as reference, held-out
    images as queries); None when there are none (`run.data.knn_skipped` says why)."""
    knn = run.data.knn
    if knn is None:
        return None
    was_training = run.method.training
    run.method.eval()
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast_dtype is torch.bfloat16):
        acc = knn_accuracy(run.method.embed, knn.reference, knn.reference_labels, knn.queries, knn.query_labels,
                           run.to_eval, knn.num_classes, k=run.cfg.knn_k, t=run.cfg.knn_t)
    run.method.train(was_training)
    return acc


def describe_data(run: Run) -> None:
    """One line on rank 0 for what is not the in-memory default: streamed data, and a skipped kNN."""
    d = run.data
    if d.mode == "stream":
        src: Any = d.source   # StreamingBatches
        print(f"unison: streaming {d.num_images} images from {run.cfg.data} at {d.image_size} px: "
              f"{src.loader_workers} loader process(es) per worker, decode on {src.decode_on}", file=sys.stderr,
              flush=True)
    if d.knn_skipped:
        print(f"unison: kNN evaluation skipped: {d.knn_skipped}", file=sys.stderr, flush=True)


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
        self.warned = True
        d = self.run.data
        advice = (f"raise --loader-workers (now {getattr(d.source, 'loader_workers', 0)}) or use --decode gpu"
                  if d.mode == "stream" else "the in-memory augmentation is the bottleneck (see unison bench)")
        print(f"unison: warning: the training step waited for data {share:.0%} of the time up to step {step} "
              f"(more than {self.SHARE:.0%}); {advice}", file=sys.stderr, flush=True)


def _resume_after_restart(cfg: TrainConfig, run_dir: Path) -> None:
    """Restarted by torchrun --max-restarts or requeued by SLURM: continue from the run directory's last checkpoint."""
    reason = restart_reason()
    if reason and not cfg.resume and C.all_gather_object(latest_checkpoint(run_dir) is not None)[0]:  # rank 0 decides
        cfg.resume = str(run_dir)
        if C.rank() == 0:
            message = f"unison: {reason}: resuming from {latest_checkpoint(run_dir)}"
            print(message, file=sys.stderr, flush=True)
            RunLog(run_dir).line(message)


def stop_after_step(run: Run, checkpointer: Checkpointer, watch: Watchdog, agreement: StopAgreement, step: int,
                    history: dict[str, Any], saved_now: bool) -> None:
    """After every step: agree with the other ranks whether to stop; on a stop request save and raise `Preempted`.

    A failed background save ends the run with its error (rank 0) on every rank.
    """
    with watch.phase("collective", step):
        decision = agreement.exchange(stop_requests(), checkpointer.failed())
    if decision.save_failed:
        checkpointer.raise_if_failed()     # rank 0: the save's own error
        raise save_failed_elsewhere()
    if not decision.stop:
        return
    with watch.phase("checkpoint", step):
        if not saved_now:
            save_run_checkpoint(run, checkpointer, step, history)
        path = checkpointer.wait()         # the preemption checkpoint is complete before anyone exits
        if path is None and C.rank() == 0:   # --shard full: written by every rank through DCP
            path = latest_checkpoint(checkpointer.run_dir)
        C.barrier()
    raise preempted(decision, step, run.total_steps, str(path) if path is not None else None)


def train(cfg: TrainConfig, device: torch.device) -> Summary:
    """Train on this rank (the process group is initialised); every rank returns the same `Summary`."""
    rank = C.rank()
    install_stop_handlers()    # SIGTERM/SIGUSR1: finish the step, checkpoint, exit 75 (unison.training.preemption)
    watch = Watchdog(rank, cfg.distributed.watchdog_s)
    faults = FaultHook(rank)   # testing only (UNISON_FAULT_INJECT); does nothing otherwise
    checkpointer = Checkpointer(cfg.out, cfg.keep_checkpoints, asynchronous=cfg.checkpoint_async,
                                on_write=faults.during_save)
    try:
        with contextlib.ExitStack() as on_exit:   # what a failed run must still close (its metrics file)
            return _train(cfg, device, watch, faults, checkpointer, on_exit)
    except KeyboardInterrupt:
        checkpointer.close(abort=True)     # Ctrl-C: end promptly, no half-written checkpoint
        raise
    finally:
        checkpointer.close()               # a good save in flight completes (errors elsewhere end the run anyway)
        watch.close()
        restore_default_handlers()         # in-process runs (world size 1, tests): the caller's handlers again


def _train(cfg: TrainConfig, device: torch.device, watch: Watchdog, faults: FaultHook, checkpointer: Checkpointer,
           on_exit: contextlib.ExitStack) -> Summary:
    rank, world = C.rank(), C.world_size()
    master = rank == 0
    consistent_config(cfg)
    torch.set_num_threads(threads_per_worker(cfg, world))
    run = build_run(cfg, device)
    run_dir = Path(cfg.out)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "resolved": run.resolved}, indent=2) + "\n")
        describe_data(run)

    # ---- resume, or record the random-initialisation baseline
    runlog = RunLog(run_dir, enabled=master)
    _resume_after_restart(cfg, run_dir)
    step, history = resume_run(run, cfg.resume) if cfg.resume else (0, {})
    runlog.line(start_line(run, world, step))
    if step == 0 and cfg.random_init_knn and history.get("random_init_knn_top1") is None:   # never a trained encoder
        with watch.phase("eval", step):
            history["random_init_knn_top1"] = knn_top1(run)
        if history["random_init_knn_top1"] is not None:
            runlog.line(f"random-init kNN top-1 {history['random_init_knn_top1']:.4f}")

    logger = MetricsLogger(run_dir, enabled=master, kind=cfg.logger, config=cfg.to_dict())
    on_exit.callback(logger.release)
    progress = progress_bar(run.total_steps, step, f"{cfg.method} x{world}") if master and cfg.progress else None
    first_step = step + 1   # logged too, so the loss shows from the first step on

    # ---- the loop
    agreement = StopAgreement()   # preemption signals and failed saves, agreed by all ranks after every step
    run.method.train()
    t_start = time.perf_counter()
    t_log, images_since_log, wait_s, wait_since_log = time.perf_counter(), 0, 0.0, 0.0
    waits = DataWaitWarning(run) if master else None
    final_loss = float("nan")
    curve: list[tuple[int, float]] = []   # (step, loss) of every logged step, for `Summary.loss_curve`
    log_times: list[float] = []
    loss_sum = torch.zeros((), device=device, dtype=run.dtype)
    poison = False
    for batch in watch.data(faults.batches(batches(run, step)), step):   # heartbeat: "data" while a batch is made
        if batch.micro == 0:
            poison = faults.before_step(batch.step)
            loss_sum.zero_()
        wait_s += batch.wait_s
        wait_since_log += batch.wait_s
        loss_sum += forward_backward(run, batch, poison=poison)
        if batch.micro < run.accumulate - 1:
            continue
        lr = optimizer_step(run, batch.step)
        step = batch.step + 1
        images_since_log += run.global_batch * run.accumulate

        # ---- hooks: metrics, progress, evaluation, checkpoints
        epoch_done = step % run.steps_per_epoch == 0
        if step % cfg.log_every == 0 or step == run.total_steps or epoch_done or step == first_step:
            final_loss = float(C.all_reduce_no_grad(loss_sum / run.accumulate, average=True))
            curve.append((step, final_loss))
            log_times.append(time.perf_counter() - t_start)
            now = time.perf_counter()
            ips = images_since_log / max(now - t_log, 1e-9)
            data_wait = min(1.0, wait_since_log / max(now - t_log, 1e-9))   # this rank's share of the window
            t_log, images_since_log, wait_since_log = now, 0, 0.0
            logger.log(step=step, epoch=step / run.steps_per_epoch, loss=final_loss, lr=lr, images_per_s=ips,
                       data_wait=round(data_wait, 4))
            if progress is not None:
                progress.set_postfix(loss=f"{final_loss:.4f}", img_s=f"{ips:.0f}", data=f"{data_wait:.0%}")
            runlog.line(f"step {step}/{run.total_steps} (epoch {step / run.steps_per_epoch:.2f}): loss "
                        f"{final_loss:.4f}, lr {lr:.4g}, {ips:.0f} img/s")
            if waits is not None:
                waits.observe(step, data_wait)
        if progress is not None:
            progress.update(1)
        completed_epoch = step // run.steps_per_epoch
        if (epoch_done and cfg.eval_every and completed_epoch % cfg.eval_every == 0 and step < run.total_steps
                and run.data.knn is not None):
            with watch.phase("eval", step):
                acc = knn_top1(run)
            logger.log(step=step, epoch=float(completed_epoch), knn_top1=acc)
            if acc is not None:
                runlog.line(f"epoch {completed_epoch}: kNN top-1 {acc:.4f}")
        due = step % cfg.checkpoint_every == 0 if cfg.checkpoint_every else epoch_done
        if due and step < run.total_steps:
            with watch.phase("checkpoint", step):
                save_run_checkpoint(run, checkpointer, step, history)
        if step < run.total_steps:   # the last step goes on to the final checkpoint anyway
            stop_after_step(run, checkpointer, watch, agreement, step, history, saved_now=due)
        watch.arm()   # start-up (the first step, compile included) is over: the watchdog watches from here
    agreement.close()
    if progress is not None:
        progress.close()
    train_time = time.perf_counter() - t_start

    # ---- the end: evaluation, last checkpoint, summary
    with watch.phase("eval", step):
        history["knn_top1"] = knn_top1(run)
    logger.log(step=step, epoch=step / run.steps_per_epoch, knn_top1=history["knn_top1"])
    if history["knn_top1"] is not None:
        runlog.line(f"step {step}: kNN top-1 {history['knn_top1']:.4f}")
    with watch.phase("checkpoint", step):
        save_run_checkpoint(run, checkpointer, step, history)
        checkpointer.wait()
    watch.enter("done", step)
    summary = Summary(
        method=cfg.method, backbone=run.resolved["backbone"], data=cfg.data, world_size=world, steps=step,
        epochs=step / run.steps_per_epoch, global_batch=run.global_batch, image_size=run.image_size,
        train_images=run.data.num_images, val_images=run.data.knn.queries.shape[0] if run.data.knn else 0,
        final_loss=final_loss, knn_top1=history["knn_top1"], random_init_knn_top1=history.get("random_init_knn_top1"),
        train_time_s=train_time, data_wait_fraction=wait_s / max(train_time, 1e-9),
        peak_memory_mib=C.all_gather_object(round(peak_memory_mib(device), 1)),
        peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "peak_rss", out=str(run_dir),
        loss_curve=curve, log_times_s=log_times, mean=run.resolved["mean"], std=run.resolved["std"],
        extra={"checkpoint_wait_s": [round(t, 4) for t in checkpointer.wait_s]})   # per save, the final one last
    if master:
        (run_dir / "summary.json").write_text(json.dumps(summary.to_json_dict(), indent=2) + "\n")
        logger.close(random_init_knn_top1=history.get("random_init_knn_top1"))
    return summary


def start_line(run: Run, world: int, step: int) -> str:
    """The first ``train.log`` line of a run (or of a resumed attempt): what runs, and the values it resolved to."""
    r, cfg = run.resolved, run.cfg
    where = f"resuming at step {step}" if step else "starting"
    return (f"{cfg.method} x{world} workers on {cfg.data}, {where}: {run.total_steps} steps ({run.steps_per_epoch} per "
            f"epoch), global batch {run.global_batch}, {cfg.backbone} at {run.image_size} px, {r['optimizer']} peak lr "
            f"{r['peak_lr']:.4g}, weight decay {r['weight_decay']:g}, augmentation {r['augmentation']}; run dir "
            f"{cfg.out}")
