"""The training loop: every worker runs `train_worker`, top to bottom.

1. Join the process group (unison's launcher, torchrun, SLURM or mpirun set the variables).
2. Build the step (`unison.train.step.build_run`): data, augmentation, method, SyncBN, DDP,
   optimizer, schedule — the same step `unison check` proves exact.
3. Resume from a checkpoint (``--resume``, or by itself when torchrun restarted this worker),
   or record the random-initialisation kNN baseline.
4. For each of this rank's micro-batches: `forward_backward`; after the last one of a step,
   `optimizer_step`. Around the step, the hooks: metrics and progress, kNN evaluation every
   few epochs, checkpoints (rank 0 writes; sharded optimizer state consolidated first).
5. At the end: kNN evaluation, the last checkpoint, `summary.json`, and the `Summary`
   returned to the caller (rank 0's is what `unison.train` returns).
"""

from __future__ import annotations

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
    restart_count,
    shutdown_distributed,
)
from unison.errors import ConfigError
from unison.eval.knn import knn_accuracy
from unison.train.checkpoint import (
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    pack_rng_state,
    restore_rng_state,
    save_checkpoint,
)
from unison.train.faults import FaultHook
from unison.train.metrics import MetricsLogger, progress_bar
from unison.train.runlog import RunLog
from unison.train.step import Run, batches, build_run, forward_backward, optimizer_step, threads_per_worker
from unison.train.summary import Summary, peak_memory_mib


def train_worker(payload: dict[str, Any]) -> dict[str, Any]:
    """Entry point of one worker process (unison's launcher, torchrun, srun or mpirun): its `Summary` as a dict."""
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


def knn_top1(run: Run) -> float:
    """Weighted kNN top-1 of the encoder: training set as reference, held-out set as queries."""
    assert run.val_set is not None, "kNN needs a held-out set"
    was_training = run.method.training
    run.method.eval()
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.autocast_dtype is torch.bfloat16):
        acc = knn_accuracy(run.method.embed, run.train_set.images, run.train_set.labels, run.val_set.images,
                           run.val_set.labels, run.to_eval, len(run.train_set.classes), k=run.cfg.knn_k,
                           t=run.cfg.knn_t)
    run.method.train(was_training)
    return acc


def save_run_checkpoint(run: Run, run_dir: Path, step: int, history: dict[str, Any]) -> None:
    """Every rank takes part (sharded optimizer state and RNG states are collected); rank 0 writes."""
    optim_state = run.optimizer.state_dict()   # collective when sharded: every rank calls it
    rng_states = C.all_gather_object(pack_rng_state())
    if C.rank() == 0:
        state = {"method": run.cfg.method, "config": run.cfg.to_dict(), "resolved": run.resolved,
                 "model": run.method.state_dict(), "optimizer": optim_state, "step": step,
                 "world_size": C.world_size(), "rng": rng_states, "history": history}
        save_checkpoint(run_dir, state, step, keep=run.cfg.keep_checkpoints)
    C.barrier()


def resume(run: Run, path: str) -> tuple[int, dict[str, Any]]:
    """Load model, optimizer and (at the same world size) RNG state; return (step, history)."""
    ckpt = load_checkpoint(path, expect_method=run.cfg.method, map_location=run.device)
    check_compatible(run.method, ckpt["model"])
    run.method.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    rank, world = C.rank(), C.world_size()
    if ckpt.get("rng") is not None and world == ckpt.get("world_size"):
        restore_rng_state(ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0])
    return int(ckpt["step"]), dict(ckpt.get("history") or {})


def _resume_after_restart(cfg: TrainConfig, run_dir: Path) -> None:
    """Restarted by torchrun --max-restarts: continue from the run directory's last checkpoint."""
    if restart_count() > 0 and C.all_gather_object(latest_checkpoint(run_dir) is not None)[0]:  # rank 0 decides
        cfg.resume = str(run_dir)
        if C.rank() == 0:
            message = f"unison: restart {restart_count()}: resuming from {latest_checkpoint(run_dir)}"
            print(message, file=sys.stderr, flush=True)
            RunLog(run_dir).line(message)


def train(cfg: TrainConfig, device: torch.device) -> Summary:
    """Train on this rank (the process group is initialised); every rank returns the same `Summary`."""
    rank, world = C.rank(), C.world_size()
    master = rank == 0
    consistent_config(cfg)
    faults = FaultHook(rank)   # testing only (UNISON_FAULT_INJECT); does nothing otherwise
    torch.set_num_threads(threads_per_worker(cfg, world))
    run = build_run(cfg, device)
    run_dir = Path(cfg.out)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "resolved": run.resolved}, indent=2) + "\n")

    # ---- resume, or record the random-initialisation baseline
    runlog = RunLog(run_dir, enabled=master)
    _resume_after_restart(cfg, run_dir)
    step, history = resume(run, cfg.resume) if cfg.resume else (0, {})
    runlog.line(start_line(run, world, step))
    if step == 0 and cfg.random_init_knn and history.get("random_init_knn_top1") is None:   # never a trained encoder
        history["random_init_knn_top1"] = knn_top1(run)
        runlog.line(f"random-init kNN top-1 {history['random_init_knn_top1']:.4f}")

    logger = MetricsLogger(run_dir, enabled=master, kind=cfg.logger, config=cfg.to_dict())
    progress = progress_bar(run.total_steps, step, f"{cfg.method} x{world}") if master and cfg.progress else None
    first_step = step + 1   # logged too, so the loss shows from the first step on

    # ---- the loop
    run.method.train()
    t_start = time.perf_counter()
    t_log, images_since_log, wait_s = time.perf_counter(), 0, 0.0
    final_loss = float("nan")
    curve: list[tuple[int, float]] = []   # (step, loss) of every logged step, for `Summary.loss_curve`
    log_times: list[float] = []
    loss_sum = torch.zeros((), device=device, dtype=run.dtype)
    poison = False
    for batch in batches(run, step):
        if batch.micro == 0:
            poison = faults.before_step(batch.step)
            loss_sum.zero_()
        wait_s += batch.wait_s
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
            t_log, images_since_log = now, 0
            logger.log(step=step, epoch=step / run.steps_per_epoch, loss=final_loss, lr=lr, images_per_s=ips)
            if progress is not None:
                progress.set_postfix(loss=f"{final_loss:.4f}", img_s=f"{ips:.0f}")
            runlog.line(f"step {step}/{run.total_steps} (epoch {step / run.steps_per_epoch:.2f}): loss "
                        f"{final_loss:.4f}, lr {lr:.4g}, {ips:.0f} img/s")
        if progress is not None:
            progress.update(1)
        completed_epoch = step // run.steps_per_epoch
        if epoch_done and cfg.eval_every and completed_epoch % cfg.eval_every == 0 and step < run.total_steps:
            acc = knn_top1(run)
            logger.log(step=step, epoch=float(completed_epoch), knn_top1=acc)
            runlog.line(f"epoch {completed_epoch}: kNN top-1 {acc:.4f}")
        due = step % cfg.checkpoint_every == 0 if cfg.checkpoint_every else epoch_done
        if due and step < run.total_steps:
            save_run_checkpoint(run, run_dir, step, history)
    if progress is not None:
        progress.close()
    train_time = time.perf_counter() - t_start

    # ---- the end: evaluation, last checkpoint, summary
    history["knn_top1"] = knn_top1(run)
    logger.log(step=step, epoch=step / run.steps_per_epoch, knn_top1=history["knn_top1"])
    runlog.line(f"step {step}: kNN top-1 {history['knn_top1']:.4f}")
    save_run_checkpoint(run, run_dir, step, history)
    summary = Summary(
        method=cfg.method, backbone=cfg.backbone, data=cfg.data, world_size=world, steps=step,
        epochs=step / run.steps_per_epoch, global_batch=run.global_batch, image_size=run.image_size,
        train_images=len(run.train_set), val_images=len(run.val_set) if run.val_set is not None else 0,
        final_loss=final_loss, knn_top1=history["knn_top1"], random_init_knn_top1=history.get("random_init_knn_top1"),
        train_time_s=train_time, data_wait_fraction=wait_s / max(train_time, 1e-9),
        peak_memory_mib=C.all_gather_object(round(peak_memory_mib(device), 1)),
        peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "peak_rss", out=str(run_dir),
        loss_curve=curve, log_times_s=log_times, mean=run.resolved["mean"], std=run.resolved["std"])
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
