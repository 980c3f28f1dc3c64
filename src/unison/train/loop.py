"""The training loop: every worker runs `train_worker`, top to bottom.

1. Join the process group (unison's launcher, torchrun, SLURM or mpirun set the variables).
2. Load the data once as a uint8 tensor on the device; every rank holds it all and takes
   its contiguous slice of each global batch, whose order is a function of (seed, epoch).
3. Build the method, convert batch norm to SyncBN, wrap in DDP (`unison.distributed.ddp`).
4. Optimiser (optionally ZeRO-1 sharded), linear warm-up + cosine learning rate derived
   from the step (no scheduler state to lose), gradient accumulation via ``no_sync``.
5. Each step: augment the local slice on the device (views depend on (seed, epoch, sample
   index) only, so they are the same whatever the world size), forward, backward, step,
   momentum/EMA updates. Non-finite losses stop the run with the step and rank.
   Under ``torchrun --max-restarts N`` a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0)
   resumes from the run directory's last complete checkpoint by itself.
6. kNN evaluation every few epochs and at the end (reference set embedded in shards),
   checkpoints (rank 0 writes; sharded optimiser state consolidated first), metrics CSV,
   a plot, and `summary.json`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from unison.config import TrainConfig
from unison.data.augment import ViewAugmenter, eval_transform
from unison.data.datasets import load_dataset
from unison.data.random import global_batches
from unison.distributed import collectives as C
from unison.distributed.config import ConfigError
from unison.distributed.ddp import grad_sync_context, unwrap, wrap_ddp
from unison.distributed.env import apply_launch_env, detect_launch_env, init_distributed, shutdown_distributed
from unison.distributed.optim import ShardedOptimizer, build_optimizer
from unison.distributed.sync_batchnorm import convert_sync_batchnorm
from unison.eval.knn import knn_accuracy
from unison.methods import get_method
from unison.models import build_backbone
from unison.train.checkpoint import (check_compatible, latest_checkpoint, load_checkpoint, pack_rng_state,
                                     restore_rng_state, save_checkpoint)
from unison.train.metrics import MetricsLogger


class NonFiniteLossError(FloatingPointError):
    pass


def peak_memory_mib(device: torch.device) -> float:
    """This worker's peak memory so far: the CUDA allocator's peak on GPU, the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM belongs to this process image; ru_maxrss can inherit the parent's peak across fork + exec
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float) -> float:
    """Linear warm-up to `peak_lr`, then cosine decay to 0 at `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def train_worker(payload: dict[str, Any]) -> None:
    """Entry point of one worker process (unison's launcher, torchrun, srun or mpirun)."""
    cfg = TrainConfig.from_dict(payload)
    launch_env = detect_launch_env()
    if launch_env is not None:
        cfg.distributed = apply_launch_env(cfg.distributed, launch_env)
    device = init_distributed(cfg.distributed, launch_env.local_rank if launch_env else 0)
    try:
        train(cfg, device)
    finally:
        shutdown_distributed()


def _consistent_config(cfg: TrainConfig) -> None:
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


FAULT_ENV = "UNISON_FAULT_INJECT"
FAULT_KINDS = ("kill", "raise", "nan", "hang")


def _restart_count() -> int:
    """torchrun's restart attempt of this worker (0 on the first attempt and outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(value) if value.isdigit() else 0


def _fault_from_env() -> dict[str, Any] | None:
    """TESTING ONLY: the fault that ``UNISON_FAULT_INJECT`` asks for, or None.

    ``UNISON_FAULT_INJECT="rank=1,step=3[,kind=kill|raise|nan|hang][,attempt=0]"`` makes rank 1 fail
    when it is about to run step 3 (0-based, i.e. after 3 completed steps) in restart attempt 0 only,
    so a worker restarted by torchrun does not fail again. kill: SIGKILL itself; raise: a
    RuntimeError; nan: a NaN loss; hang: sleep forever (its peers time out after --timeout-s).
    The fault tests (tests/test_faults.py) use it; never set it for real runs.
    """
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    try:
        fields = dict(item.strip().split("=", 1) for item in spec.split(","))
        fault = {"rank": int(fields.pop("rank")), "step": int(fields.pop("step")),
                 "kind": fields.pop("kind", "kill"), "attempt": int(fields.pop("attempt", "0"))}
        if fields or fault["kind"] not in FAULT_KINDS:
            raise ValueError
    except (ValueError, KeyError):
        raise ConfigError(f"{FAULT_ENV}={spec!r} must look like 'rank=1,step=3[,kind=kill|raise|nan|hang]"
                          f"[,attempt=0]'; it is for testing only, unset it") from None
    return fault if fault["attempt"] == _restart_count() else None


def _inject_fault(fault: dict[str, Any] | None, rank: int, step: int) -> bool:
    """Fire the test fault if it is due on this rank at this step; True = poison this step's loss."""
    if fault is None or fault["rank"] != rank or fault["step"] != step:
        return False
    print(f"unison: {FAULT_ENV}: {fault['kind']} on rank {rank} at step {step} (t={time.time():.3f})",
          file=sys.stderr, flush=True)  # the time lets tests measure how fast the run ends
    if fault["kind"] == "kill":
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV})")
    while fault["kind"] == "hang":
        time.sleep(3600)
    return fault["kind"] == "nan"


def train(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    rank, world = C.rank(), C.world_size()
    master = rank == 0
    _consistent_config(cfg)
    fault = _fault_from_env()  # testing only
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    _seed_everything(cfg.seed, cfg.deterministic)
    run_dir = Path(cfg.out)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    # ---- data: decoded once, kept on the device as uint8
    train_set = load_dataset(cfg.data, "train", subset=cfg.subset, on_corrupt=cfg.on_corrupt, seed=cfg.seed).to(device)
    val_set = load_dataset(cfg.val or cfg.data, "val", subset=cfg.val_subset, on_corrupt=cfg.on_corrupt,
                           seed=cfg.seed).to(device)
    image_size = cfg.image_size or train_set.images.shape[-1]
    method_cls = get_method(cfg.method)
    recipe = method_cls.recipe.for_data(cfg.data)
    augment = ViewAugmenter(cfg.augmentation or recipe.augmentation, image_size, train_set.mean, train_set.std)

    dtype = getattr(torch, cfg.precision)

    def to_eval(x: torch.Tensor) -> torch.Tensor:
        x = eval_transform(x, image_size, train_set.mean, train_set.std).to(dtype)
        return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x

    global_batch = cfg.batch_size
    if len(train_set) < global_batch:
        raise ValueError(f"the training set has {len(train_set)} images, fewer than one global batch "
                         f"({global_batch}); lower --batch-size")
    batches_per_epoch = len(train_set) // global_batch
    accumulate = cfg.distributed.grad_sync_every
    steps_per_epoch = max(1, batches_per_epoch // accumulate)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    if accumulate > 1 and master:
        warnings.warn("gradient accumulation (grad_sync_every > 1) is not equivalent to a larger batch for "
                      "batch-coupled losses (negatives, batch norm, Sinkhorn, cross-correlation)", stacklevel=1)

    # ---- model: same initialisation on every rank (seeded), SyncBN, DDP
    backbone, feature_dim = build_backbone(cfg.backbone)
    params = method_cls.Params(**cfg.method_params)
    model = method_cls(backbone, feature_dim, params, gather_distributed=cfg.distributed.gather_distributed,
                       shared_queue=cfg.distributed.shared_queue, steps_total=total_steps).to(device, dtype)
    if cfg.distributed.sync_batchnorm:
        model = convert_sync_batchnorm(model, device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = wrap_ddp(model, cfg.distributed, device)
    method = unwrap(ddp)
    forward = torch.compile(ddp) if cfg.compile else ddp

    # ---- optimiser and learning rate (scaled linearly with the global batch)
    peak_lr = (cfg.lr if cfg.lr is not None else recipe.base_lr) * global_batch * accumulate / 256
    weight_decay = cfg.weight_decay if cfg.weight_decay is not None else recipe.weight_decay
    trainable = [p for p in method.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optimizer or recipe.optimizer, trainable, lr=peak_lr,
                                weight_decay=weight_decay, momentum=cfg.momentum)
    if cfg.distributed.shard_optimizer:
        optimizer = ShardedOptimizer(trainable, type(optimizer), **optimizer.defaults)
    warmup_steps = min(total_steps - 1, int(cfg.warmup_epochs * steps_per_epoch)) if total_steps > 1 else 0

    # ---- resume, or record the random-initialisation baseline
    step = 0
    history: dict[str, Any] = {"random_init_knn_top1": None}
    if _restart_count() > 0:  # restarted by torchrun --max-restarts: continue from the last checkpoint
        if C.all_gather_object(latest_checkpoint(run_dir) is not None)[0]:  # rank 0's view decides for all
            cfg.resume = str(run_dir)
            if master:
                print(f"unison: restart {_restart_count()}: resuming from {latest_checkpoint(run_dir)}",
                      file=sys.stderr, flush=True)
    if cfg.resume:
        ckpt = load_checkpoint(cfg.resume, expect_method=cfg.method, map_location=device)
        check_compatible(method, ckpt["model"])
        method.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step = int(ckpt["step"])
        history = dict(ckpt.get("history", history))
        if ckpt.get("rng") is not None and world == ckpt.get("world_size"):
            restore_rng_state(ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0])

    def evaluate() -> float:
        was_training = method.training
        method.eval()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16" and device.type == "cuda"):
            acc = knn_accuracy(method.embed, train_set.images, train_set.labels, val_set.images, val_set.labels,
                               to_eval, len(train_set.classes), k=cfg.knn_k, t=cfg.knn_t)
        method.train(was_training)
        return acc

    if history["random_init_knn_top1"] is None:
        history["random_init_knn_top1"] = evaluate()

    def checkpoint(step: int) -> None:
        optim_state = optimizer.state_dict()   # collective when sharded: every rank calls it
        rng_states = C.all_gather_object(pack_rng_state())
        if master:
            save_checkpoint(run_dir, {"method": cfg.method, "config": cfg.to_dict(), "model": method.state_dict(),
                                      "optimizer": optim_state, "step": step, "world_size": world,
                                      "rng": rng_states, "history": history}, step, keep=cfg.keep_checkpoints)
        C.barrier()

    logger = MetricsLogger(run_dir, enabled=master)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
    progress = None
    if master and cfg.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=step, desc=f"{cfg.method} x{world}", unit="step",
                        mininterval=1.0, dynamic_ncols=True)

    # ---- the loop
    method.train()
    rows = C.local_slice(global_batch)
    epoch_batches: dict[int, list[torch.Tensor]] = {}
    t_start = time.perf_counter()
    t_log, images_since_log = time.perf_counter(), 0
    final_loss = float("nan")
    while step < total_steps:
        poison = _inject_fault(fault, rank, step)  # testing only (UNISON_FAULT_INJECT); normally False
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps, warmup_steps, peak_lr)
        loss_sum = torch.zeros((), device=device, dtype=dtype)
        for micro in range(accumulate):
            batch_number = step * accumulate + micro
            epoch, index_in_epoch = divmod(batch_number, batches_per_epoch)
            if epoch not in epoch_batches:
                epoch_batches = {epoch: global_batches(len(train_set), global_batch, epoch, cfg.seed)}
            indices = epoch_batches[epoch][index_in_epoch].to(device)[rows]
            views = [v.to(dtype) for v in augment(train_set.images[indices], indices, epoch=epoch, seed=cfg.seed)]
            if cfg.channels_last:
                views = [v.contiguous(memory_format=torch.channels_last) for v in views]
            with grad_sync_context(ddp, micro, accumulate):
                with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                    loss = forward(views)
                if poison:
                    loss = loss * float("nan")
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"non-finite loss ({float(loss.detach())}) at step {step} on rank {rank}; lower --lr, "
                        "set --grad-clip, or check the data (the last checkpoint is intact)")
                scaler.scale(loss / accumulate).backward()
            loss_sum += loss.detach()
        if cfg.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        method.on_after_step(step)
        step += 1
        images_since_log += global_batch * accumulate

        epoch_done = step % steps_per_epoch == 0
        if step % cfg.log_every == 0 or step == total_steps or epoch_done:
            mean_loss = float(C.all_reduce_no_grad(loss_sum / accumulate, average=True))
            final_loss = mean_loss
            now = time.perf_counter()
            ips = images_since_log / max(now - t_log, 1e-9)
            t_log, images_since_log = now, 0
            logger.log(step=step, epoch=step / steps_per_epoch, loss=mean_loss, lr=optimizer.param_groups[0]["lr"],
                       images_per_s=ips)
            if progress is not None:
                progress.set_postfix(loss=f"{mean_loss:.4f}", img_s=f"{ips:.0f}")
        if progress is not None:
            progress.update(1)
        completed_epoch = step // steps_per_epoch
        if epoch_done and cfg.eval_every and completed_epoch % cfg.eval_every == 0 and step < total_steps:
            logger.log(step=step, epoch=float(completed_epoch), knn_top1=evaluate())
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or (not cfg.checkpoint_every and epoch_done):
            if step < total_steps:
                checkpoint(step)
    if progress is not None:
        progress.close()
    train_time = time.perf_counter() - t_start

    knn_top1 = evaluate()
    logger.log(step=step, epoch=step / steps_per_epoch, knn_top1=knn_top1)
    history["knn_top1"] = knn_top1
    checkpoint(step)
    peak_memory = C.all_gather_object(round(peak_memory_mib(device), 1))  # per rank, for benchmarks
    summary = {
        "method": cfg.method, "backbone": cfg.backbone, "data": cfg.data, "world_size": world, "steps": step,
        "epochs": step / steps_per_epoch, "global_batch": global_batch, "image_size": image_size,
        "train_images": len(train_set),
        "val_images": len(val_set), "final_loss": final_loss, "knn_top1": knn_top1,
        "random_init_knn_top1": history["random_init_knn_top1"], "train_time_s": train_time,
        "peak_memory_mib": peak_memory,
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "peak_rss",
    }
    if master:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.close()
    return summary
