"""`unison plan`: what one rank of a W-rank job will need, from the production step run on simulated tensors.

`plan(cfg, gpu)` builds the step `unison train` runs (`unison.training.step.build_run`) for rank 0 of a simulated
W-rank job (`unison.plan.fake.fake_cluster`: torch's fake process group, `FakeTensorMode`, nothing the size of
the model or the batch allocated) and runs one full step (forward, backward, optimizer, EMA/queue/centre updates)
on its ``--grad-sync-every`` local micro-batches (above `SIMULATED_MICRO_BATCHES`, a few, extrapolated linearly),
under torch's `MemTracker`, `FlopCounterMode` and `CommMeter`. The data is checked and sized as `unison train`'s
pre-flight does it (`planned_data`: it exists, a batch and a step fit in it, the image size is the data's), then
synthetic views of that size stand in for its images:

* memory per rank at the step's peak: activations (+ temporaries) and the peak as measured, parameters, gradients
  and optimizer state as `unison.training.memory.model_state` estimates them (the pre-flight's check shares it);
* the largest local batch that fits the GPU: a linear fit of the simulated peak at two local batches
  (peak = fixed + per-image x batch; activations are linear in the batch);
* matrix FLOPs per step (the `FlopCounterMode` count `unison.bench.flops` uses) and bytes handed to collectives
  (`CommMeter`, plus DDP's gradient all-reduce, one payload of the synchronised gradients), the time those bytes
  take at the GPU's interconnect bandwidth and an *estimated* step time and images/s at a stated MFU;
* every host synchronisation the step makes (`HostSyncRecorder`), with where it happens;
* `cuda_check`: the same step's GPU code path on fake CUDA tensors, all but the backward (AutocastCUDA,
  torch.nn.SyncBatchNorm, DDP on a device, the optimizer and EMA updates): device mismatches and host syncs.

What is simulated and what is not: the measured step's tensors are fake CPU tensors, because the autograd
engine cannot run a backward on fake CUDA tensors without a CUDA runtime (`cuda_check` runs the rest there);
``--amp bf16|fp16`` is autocast on the CPU with that dtype (as `build_run` sets it on any device; what
AutocastCUDA would cast, near enough: both cast matmuls and convolutions). SyncBN is unison's CPU
`GlobalBatchNorm` (same collectives as torch's: a gather of 2C+1 and an all-reduce of 2C per layer), FSDP2
keeps fp32 parameters (its bf16 mixed-precision policy is GPU-only), and kernel speed, NCCL and fragmentation of
the CUDA caching allocator are not simulated: GPU figures are estimates.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from unison.config import TrainConfig
from unison.config.budget import parse_duration
from unison.distributed.comm_meter import CommMeter
from unison.errors import ConfigError
from unison.progress import Stages
from unison.training.memory import model_state

from .batches import micro_batches, step_images, synthetic_train_set
from .fake import HostSync, HostSyncRecorder, fake_cluster
from .gpus import GPU, resolve_gpu
from .progress import PlanProgress
from .report import MIB, CudaCheck, PlanReport, StepFigures
from .tracking import (
    activations_and_peak,
    ddp_grad_bytes,
    fsdp_bytes,
    params_and_buffers_at_peak,
    tracker_class,
)

DEFAULT_MFU = 0.4
DEFAULT_IMAGE_SIZE = 224   # `plan_config` without --image-size and without reading the data
# `--data` of a plan made without data (the CLI sets it when none is given): the model and the image size alone
NO_DATA = "(no --data)"
__all__ = ["GPU", "MIB", "NO_DATA", "CudaCheck", "PlanProgress", "PlanReport", "StepFigures", "cuda_check", "plan",
           "plan_config", "planned_data", "resolve_gpu", "simulate", "step_host_syncs"]


def simulate(cfg: TrainConfig, warmup: bool = True, *, images: int | None = None) -> StepFigures:
    """Rank 0's figures for one step of `cfg` (``cfg.batch_size`` global, ``world_size`` ranks, ``grad_sync_every``
    micro-batches: the step `unison train` runs), simulated; `images`: the data's training images.
    `warmup`: measure the second step (the first creates the optimizer's state); False for host syncs only."""
    from torch.utils.flop_counter import FlopCounterMode

    from unison.training.resolve import exact_accumulation
    from unison.training.step import accumulated_forward_backward, build_run, optimizer_step

    world = cfg.distributed.world_size
    local = cfg.batch_size // world
    train_set = synthetic_train_set(step_images(cfg, images))
    with fake_cluster(world) as (_, device):
        with HostSyncRecorder():   # the build's (FSDP2 reads shard sizes): once, not per step
            run = build_run(cfg, device, train_set=train_set)
        micro = micro_batches(run, local, device)
        if warmup:
            with HostSyncRecorder():   # step 0 creates the optimizer's state: the steady state is step 1's
                accumulated_forward_backward(run, micro)
                optimizer_step(run, 0)
            for batch in micro:
                batch.step = 1
        tracker = tracker_class()()
        tracker.track_external(run.parallel_model, run.optimizer)
        flops = FlopCounterMode(display=False)
        with tracker, CommMeter() as meter, flops, HostSyncRecorder() as syncs:
            accumulated_forward_backward(run, micro)
            optimizer_step(run, micro[0].step)
        peak = tracker.get_tracker_snapshot("peak")
        comm = dict(meter.bytes)
        if cfg.distributed.shard == "full":   # FSDP2's collectives bypass torch.distributed's Python names
            comm.update(fsdp_bytes(run, cfg.distributed.reshard_after_forward))
        elif not exact_accumulation(cfg):   # DDP's all-reduce (its Python reducer here; exact's is metered)
            comm["all_reduce"] = comm.get("all_reduce", 0) + ddp_grad_bytes(run)
        buckets = 0 if cfg.distributed.shard == "full" else ddp_grad_bytes(run)
        params_at_peak, buffers = params_and_buffers_at_peak(peak)
        state = model_state(run.method, cfg, run.resolved["optimizer"])   # the pre-flight memory check's estimate
        return StepFigures(local, state.params, buffers, state.grads, state.optimizer, *activations_and_peak(peak),
                           int(flops.get_total_flops()), comm, syncs.syncs, buckets,
                           max(0, params_at_peak - state.params))


def step_host_syncs(cfg: TrainConfig) -> list[HostSync]:
    """Every host synchronisation of one simulated step of `cfg` (rank 0), without the memory and FLOP figures
    (a few times cheaper than `simulate`: the suite runs it for every method x shard x amp)."""
    from unison.training.step import accumulated_forward_backward, build_run, optimizer_step

    train_set = synthetic_train_set(step_images(cfg, None))
    with fake_cluster(cfg.distributed.world_size) as (_, device):
        with HostSyncRecorder():   # the build's (FSDP2 reads shard sizes): not the step's
            run = build_run(cfg, device, train_set=train_set)
        micro = micro_batches(run, cfg.batch_size // cfg.distributed.world_size, device)
        with HostSyncRecorder() as syncs:
            accumulated_forward_backward(run, micro)
            optimizer_step(run, 0)
    return syncs.syncs


def cuda_check(cfg: TrainConfig, images: int | None = None) -> CudaCheck:
    """`forward_backward` (its backward skipped: the autograd engine needs a CUDA runtime) and `optimizer_step`
    on fake CUDA tensors: AutocastCUDA, torch.nn.SyncBatchNorm, FSDP2's bf16 policy, DDP on a device and the
    EMA/queue/centre updates, each op checked for device mismatches; gradients are zeros of the parameters."""
    from unittest import mock

    from unison.training.step import build_run, forward_backward, optimizer_step

    if cfg.distributed.shard == "full":
        return CudaCheck([], None, "FSDP2 creates CUDA streams at its first forward, which needs a CUDA runtime")
    local = cfg.batch_size // cfg.distributed.world_size
    train_set = synthetic_train_set(step_images(cfg, images))
    with fake_cluster(cfg.distributed.world_size, "cuda") as (_, device):
        with HostSyncRecorder():
            run = build_run(cfg, device, train_set=train_set)
        batch = micro_batches(run, local, device)[-1]   # the last micro-batch: DDP's synchronising one
        with HostSyncRecorder() as syncs:
            try:
                with mock.patch.object(torch.Tensor, "backward", lambda *a, **k: None):
                    forward_backward(run, batch)
                for p in run.trainable:
                    p.grad = torch.zeros_like(p)
                optimizer_step(run, batch.step)
            except RuntimeError as exc:
                if not is_device_mismatch(exc):
                    raise
                return CudaCheck(syncs.syncs, f"{exc} at {_where(exc)}")
    return CudaCheck(syncs.syncs, None)


def is_device_mismatch(exc: BaseException) -> bool:
    """Whether `exc` is fake tensors' "a CPU tensor met a CUDA one": `FakeTensorDeviceMismatchError` where torch
    has it (after 2.11), a plain RuntimeError naming the two devices in torch 2.11 and before."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
    except ImportError:
        return isinstance(exc, RuntimeError) and "found two different devices" in str(exc)
    return isinstance(exc, FakeTensorDeviceMismatchError)


def _where(exc: BaseException) -> str:
    """file:line (function) of the innermost frame of `exc` outside torch and this package."""
    import os
    import traceback

    torch_dir, here = os.path.dirname(torch.__file__), os.path.dirname(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((torch_dir, here)) and "contextlib" not in f.filename]
    return f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"





def plan_config(cfg: TrainConfig, mfu: float = DEFAULT_MFU) -> TrainConfig:
    """What `plan` simulates of the validated `cfg` (one line where it cannot); without ``--image-size``, 224 px
    here (`plan` itself takes the data's size: `planned_data`)."""
    if cfg.distributed.grad_compression != "none":
        raise ConfigError("unison plan does not simulate --grad-compression; leave it at none")
    if cfg.compile:
        raise ConfigError("unison plan does not simulate --compile; leave it off")
    if not 0 < mfu <= 1 or math.isnan(mfu):
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]")
    if cfg.image_size is None:
        cfg = copy.deepcopy(cfg)
        cfg.image_size = DEFAULT_IMAGE_SIZE
    return cfg


SIMULATED_MICRO_BATCHES = 8   # above: a step simulated at 4 and 8 micro-batches, extrapolated linearly in K


def plan(cfg: TrainConfig, gpu: GPU, mfu: float = DEFAULT_MFU, progress: Stages | None = None, *,
         images: int | None = None) -> PlanReport:
    """Simulate `cfg` at its local batch and at twice that; the fit gives the largest local batch that fits.

    The data is checked by train's own rules (it exists; one batch and one step of ``--grad-sync-every``
    micro-batches within its images) and the run's image size is the one train resolves (``--image-size``, else
    the data's); its images are not decoded (synthetic views of that size stand in). `images` (with
    ``cfg.image_size``): plan for data of that many images, without reading ``cfg.data``; ``cfg.data`` `NO_DATA`:
    for the model and the image size alone (``--image-size``, else `DEFAULT_IMAGE_SIZE`). ``--time-budget``: the
    steps that the estimated step time fits. `progress`: lines.
    """
    plan_config(cfg, mfu)   # what it cannot simulate, refused; the image size is the data's (`planned_data`)
    say = progress.stage if progress is not None else (lambda text: None)
    size_given = cfg.image_size is not None
    if cfg.data == NO_DATA:
        cfg = plan_config(cfg, mfu)
    elif images is None or cfg.image_size is None:
        say(f"checking --data {cfg.data}")
        cfg, images = planned_data(cfg)
    world, local = cfg.distributed.world_size, cfg.batch_size // cfg.distributed.world_size
    try:
        step, extrapolated = _simulate_step(cfg, images, say, f"one step of {world:,} ranks x {local:,} images")
        double = copy.deepcopy(cfg)
        double.batch_size = 2 * cfg.batch_size
        other, _ = _simulate_step(double, images, say, f"one step at {2 * local:,} images per rank (for the largest "
                                  "batch that fits)")
    except (AssertionError, RuntimeError, ValueError) as exc:   # what the run itself would hit at its first step
        raise ConfigError(f"this configuration's step fails on the simulated {cfg.distributed.world_size}-rank job "
                          f"(as it would at the first step of the run): {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:300]} (at {_where(exc)})") from None
    per_image = (other.peak - step.peak) / step.local_batch
    say("the GPU code path on fake CUDA tensors")
    budget = parse_duration(cfg.time_budget) if cfg.time_budget is not None else None
    return PlanReport(cfg, gpu, step, per_image, mfu, cuda_check(cfg, images), images, extrapolated, budget,
                      size_given or cfg.data != NO_DATA)


def planned_data(cfg: TrainConfig) -> tuple[TrainConfig, int]:
    """`cfg` at the image size its run trains at, and its training images, by the rules and the resolution of
    `unison train`'s pre-flight (`unison.data.source`): a missing or empty ``--data``, a batch or a step of
    ``--grad-sync-every`` micro-batches beyond its images are refused in one line."""
    from unison.data.source import planned_images
    from unison.training.resolve import plan_run

    plan = plan_run(copy.deepcopy(cfg))
    plan.cfg.image_size = plan.image_size
    return plan.cfg, planned_images(plan.spec, plan.catalogs[0])


def _simulate_step(cfg: TrainConfig, images: int | None, say: Any, what: str) -> tuple[StepFigures, str | None]:
    """One step of `cfg` with all its ``grad_sync_every`` micro-batches; above `SIMULATED_MICRO_BATCHES`, the
    step at half that and at that many, extrapolated linearly in K (activations, the peak and the FLOPs grow
    linearly with the micro-batches; parameters, gradients, optimizer state and collectives do not)."""
    k = cfg.distributed.grad_sync_every
    if k <= SIMULATED_MICRO_BATCHES:
        say(f"simulating {what}" + (f" x {k} micro-batches" if k > 1 else ""))
        return simulate(cfg, images=images), None
    low, high = SIMULATED_MICRO_BATCHES // 2, SIMULATED_MICRO_BATCHES
    figures = []
    for n in (low, high):
        say(f"simulating {what} x {n} micro-batches (extrapolated to {k:,})")
        fewer = copy.deepcopy(cfg)
        fewer.distributed.grad_sync_every = n
        figures.append(simulate(fewer, images=images))
    a, b = figures

    def at_k(x: int, y: int) -> int:
        return int(round(y + (y - x) / (high - low) * (k - high)))

    step = dataclasses.replace(b, activations=at_k(a.activations, b.activations), peak=at_k(a.peak, b.peak),
                               flops=at_k(a.flops, b.flops))
    return step, f"simulated at {low} and {high}, extrapolated linearly to {k:,}"
