"""`unison plan`: what one rank of a W-rank job will need, from the production step run on simulated tensors.

`plan(cfg, gpu)` builds the step `unison train` runs (`unison.training.step.build_run`) for rank 0 of a simulated
W-rank job (`unison.plan.fake.fake_cluster`: torch's fake process group, `FakeTensorMode`, nothing the size of
the model or the batch allocated) and runs one full step (forward, backward, optimizer, EMA/queue/centre updates)
on its ``--grad-sync-every`` local micro-batches (above `SIMULATED_MICRO_BATCHES`, a few, extrapolated linearly),
under torch's `MemTracker`, `FlopCounterMode` and `CommMeter`. The data is checked and sized as `unison train`'s
pre-flight does it (`planned_data`: it exists, a batch and a step fit in it, the image size is the data's), then
synthetic views of that size stand in for its images:

* memory per rank at the step's peak: parameters, gradients, optimizer state, activations (+ temporaries);
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
from dataclasses import dataclass, field
from typing import Any

import torch

from unison.config import TrainConfig
from unison.distributed.comm_meter import CommMeter
from unison.errors import ConfigError
from unison.models.backbones import resolve_backbone

from .batches import micro_batches, step_images, synthetic_train_set
from .fake import HostSync, HostSyncRecorder, fake_cluster
from .gpus import GPU, resolve_gpu
from .progress import PlanProgress
from .syncs import explained_lines, unexplained
from .tracking import (
    activations_and_peak,
    ddp_grad_bytes,
    fsdp_bytes,
    grad_bytes,
    optimizer_bytes,
    param_bytes,
    params_and_buffers_at_peak,
    tracker_class,
)

MIB = 2**20
DEFAULT_MFU = 0.4
DEFAULT_IMAGE_SIZE = 224   # `plan_config` without --image-size and without reading the data
__all__ = ["GPU", "CudaCheck", "PlanProgress", "PlanReport", "cuda_check", "plan", "plan_config", "planned_data",
           "resolve_gpu", "simulate", "step_host_syncs"]


@dataclass
class StepFigures:
    """One simulated step of one rank at one local batch (bytes)."""

    local_batch: int
    params: int          # this rank's parameters (FSDP2: its shards)
    buffers: int
    grads: int
    optimizer: int
    activations: int     # activations + temporaries at the peak
    peak: int            # everything at the step's peak
    flops: int
    comm_bytes: dict[str, int]
    host_syncs: list[HostSync] = field(default_factory=list)
    ddp_buckets: int = 0  # DDP's gradient buckets (allocated at its construction, outside the tracked step)
    gathered_params: int = 0   # FSDP2: whole parameters all-gathered and held at the peak, beyond the shards


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
            grads = grad_bytes(run)
            optimizer_step(run, micro[0].step)
        peak = tracker.get_tracker_snapshot("peak")
        comm = dict(meter.bytes)
        if cfg.distributed.shard == "full":   # FSDP2's collectives bypass torch.distributed's Python names
            comm.update(fsdp_bytes(run, cfg.distributed.reshard_after_forward))
        elif not exact_accumulation(cfg):   # DDP's all-reduce (its Python reducer here; exact's is metered)
            comm["all_reduce"] = comm.get("all_reduce", 0) + ddp_grad_bytes(run)
        buckets = 0 if cfg.distributed.shard == "full" else ddp_grad_bytes(run)
        params_at_peak, buffers = params_and_buffers_at_peak(peak)
        params = param_bytes(run)
        return StepFigures(local, params, buffers, grads, optimizer_bytes(run), *activations_and_peak(peak), int(
            flops.get_total_flops()), comm, syncs.syncs, buckets, max(0, params_at_peak - params))


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


@dataclass
class CudaCheck:
    """The step's GPU code path on fake CUDA tensors, everything but the backward (see `cuda_check`)."""

    host_syncs: list[HostSync]
    device_error: str | None    # a CPU tensor met a CUDA one: the error and where
    skipped: str | None = None  # why the check could not run


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





@dataclass
class PlanReport:
    cfg: TrainConfig
    gpu: GPU
    step: StepFigures
    per_image_bytes: float     # slope of the peak in the local batch (the linear fit)
    mfu: float
    cuda: CudaCheck
    images: int = 0                   # the data's training images
    extrapolated: str | None = None   # how a step of many micro-batches was simulated (`SIMULATED_MICRO_BATCHES`)

    @property
    def peak(self) -> int:
        """The step's tracked peak plus DDP's gradient buckets (not a copy of the gradients under FSDP)."""
        return self.step.peak + self.step.ddp_buckets

    @property
    def fits(self) -> bool:
        return self.peak <= self.gpu.memory_gib * 2**30

    @property
    def max_local_batch(self) -> int:
        room = self.gpu.memory_gib * 2**30 - (self.peak - self.per_image_bytes * self.step.local_batch)
        return max(0, int(room // self.per_image_bytes)) if self.per_image_bytes > 0 else 0

    def as_dict(self) -> dict[str, Any]:
        s, world, k = self.step, self.cfg.distributed.world_size, self.cfg.distributed.grad_sync_every
        comm = sum(s.comm_bytes.values())
        comm_s = comm / (self.gpu.interconnect_gb_s * 1e9)
        compute_s = s.flops / (self.gpu.bf16_tflops * 1e12 * self.mfu)
        step_s = compute_s + comm_s
        return {
            "method": self.cfg.method, "backbone": resolve_backbone(str(self.cfg.backbone), self.cfg.image_size),
            "image_size": self.cfg.image_size, "world_size": world, "shard": self.cfg.distributed.shard, "amp": self.cfg.amp,
            "local_batch": s.local_batch, "global_batch": self.cfg.batch_size, "grad_sync_every": k,
            "images_per_step": self.cfg.batch_size * k, "train_images": self.images,
            "steps_per_epoch": self.images // (self.cfg.batch_size * k) if self.images else None,
            "micro_batches_simulated": self.extrapolated or f"all {k}",
            "gpu": self.gpu.name, "gpu_memory_mib": round(self.gpu.memory_gib * 1024),
            "parameters_mib": s.params / MIB, "buffers_mib": s.buffers / MIB, "gradients_mib": s.grads / MIB,
            "optimizer_state_mib": s.optimizer / MIB, "activations_at_peak_mib": s.activations / MIB,
            "ddp_buckets_mib": s.ddp_buckets / MIB, "gathered_parameters_at_peak_mib": s.gathered_params / MIB,
            "peak_mib": self.peak / MIB, "fits": self.fits, "max_local_batch": self.max_local_batch,
            "max_local_batch_method": "linear fit of the simulated peak at two local batches",
            "matrix_flops_per_step": s.flops, "collective_bytes_per_step": comm,
            "collective_bytes_by_kind": dict(s.comm_bytes),
            "interconnect": f"{self.gpu.interconnect} {self.gpu.interconnect_gb_s:g} GB/s",
            "estimate_comm_s": comm_s, "estimate_compute_s": compute_s, "estimate_mfu": self.mfu,
            "estimate_step_s": step_s,
            "estimate_images_per_s": self.cfg.batch_size * k / step_s if step_s else None,
            "host_syncs": [str(h) for h in s.host_syncs],
            "host_syncs_unexplained": [str(h) for h in unexplained(s.host_syncs)],
            "cuda_path_skipped": self.cuda.skipped, "cuda_path_device_error": self.cuda.device_error,
            "cuda_path_host_syncs": [str(h) for h in self.cuda.host_syncs],
            "cuda_path_host_syncs_unexplained": [str(h) for h in unexplained(self.cuda.host_syncs)],
        }

    def text(self) -> str:
        d = self.as_dict()
        micro = (f" x {d['grad_sync_every']:,} micro-batches per step ({d['micro_batches_simulated']})"
                 if d["grad_sync_every"] > 1 else "")
        lines = [f"unison plan: {d['method']} on {d['backbone']} at {d['image_size']} px, {d['world_size']} ranks x "
                 f"{d['local_batch']} images{micro}, --shard {d['shard']}, --amp {d['amp']}, on {d['gpu']} "
                 f"(simulated); {d['train_images']:,} training images, {_count(d['steps_per_epoch'] or 0, 'step')} per epoch",
                 "per rank:"]
        keys = ("parameters", "buffers", "gradients", "optimizer_state", "activations_at_peak", "ddp_buckets",
                "gathered_parameters_at_peak", "peak")
        width = max(len(key) for key in keys) + 2
        for key in keys:
            lines.append(f"  {key.replace('_', ' '):<{width}}{d[key + '_mib']:>12,.1f} MiB")
        verdict = "fits" if d["fits"] else "does NOT fit"
        lines.append(f"  {verdict} in {d['gpu_memory_mib']:,} MiB; largest local batch that fits: "
                     f"{d['max_local_batch']} ({d['max_local_batch_method']})")
        lines.append(f"  matrix FLOPs per step   {d['matrix_flops_per_step'] / 1e12:,.3f} TFLOP")
        lines.append(f"  collectives per step    {d['collective_bytes_per_step'] / MIB:,.1f} MiB "
                     f"({d['estimate_comm_s'] * 1e3:.2f} ms at {d['interconnect']})")
        lines.append(f"  estimate: {d['estimate_step_s'] * 1e3:.1f} ms per step, "
                     f"{d['estimate_images_per_s'] or 0:,.0f} images/s at {d['estimate_mfu']:.0%} MFU "
                     "(compute + communication, no overlap)")
        lines.append(f"host synchronisations in the step: {len(d['host_syncs'])}")
        lines += explained_lines(self.step.host_syncs)
        lines.append("GPU code path on fake CUDA tensors (forward, optimizer, EMA; no backward): " + (
            f"not run ({self.cuda.skipped})" if self.cuda.skipped else
            f"DEVICE MISMATCH: {self.cuda.device_error}" if self.cuda.device_error else
            f"no device mismatch, {len(self.cuda.host_syncs)} host synchronisations"))
        lines += explained_lines(self.cuda.host_syncs)
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


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


def plan(cfg: TrainConfig, gpu: GPU, mfu: float = DEFAULT_MFU, progress: PlanProgress | None = None, *,
         images: int | None = None) -> PlanReport:
    """Simulate `cfg` at its local batch and at twice that; the fit gives the largest local batch that fits.

    The data is checked by train's own rules (it exists; one batch and one step of ``--grad-sync-every``
    micro-batches within its images) and the run's image size is the one train resolves (``--image-size``, else
    the data's); its images are not decoded (synthetic views of that size stand in). `images` (with
    ``cfg.image_size``): plan for data of that many images, without reading ``cfg.data``. `progress`: lines.
    """
    plan_config(cfg, mfu)   # what it cannot simulate, refused; the image size is the data's (`planned_data`)
    say = progress.stage if progress is not None else (lambda text: None)
    if images is None or cfg.image_size is None:
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
    return PlanReport(cfg, gpu, step, per_image, mfu, cuda_check(cfg, images), images, extrapolated)


def planned_data(cfg: TrainConfig) -> tuple[TrainConfig, int]:
    """`cfg` at the image size its run trains at, and its training images, by the rules and the resolution of
    `unison train`'s pre-flight (`unison.data.source`): a missing or empty ``--data``, a batch or a step of
    ``--grad-sync-every`` micro-batches beyond its images are refused in one line."""
    from unison.data.source import planned_images
    from unison.training.resolve import plan_run

    plan = plan_run(copy.deepcopy(cfg))
    plan.cfg.image_size = plan.image_size
    return plan.cfg, planned_images(plan.spec, plan.catalogs[0])


def _simulate_step(cfg: TrainConfig, images: int, say: Any, what: str) -> tuple[StepFigures, str | None]:
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
