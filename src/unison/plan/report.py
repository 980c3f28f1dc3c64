"""What `unison plan` reports: one rank's figures of a simulated step (`StepFigures`), the GPU code path's check
(`CudaCheck`) and the report built from them (`PlanReport`: a dict for ``--json``, lines for the terminal).

The report names what it planned for: the data's images and steps per epoch when ``--data`` is given, the model and
the image size alone when it is not (memory, FLOPs and bytes do not depend on the number of images), and under
``--time-budget`` the steps (and epochs) that the estimated step time fits into the budget. Host synchronisations
are named by what makes them (`unison.plan.syncs`), never by torch's file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unison.config import TrainConfig
from unison.models.backbones import resolve_backbone

from .fake import HostSync
from .gpus import GPU
from .syncs import explained_lines, unexplained

__all__ = ["MIB", "CudaCheck", "PlanReport", "StepFigures"]

MIB = 2**20


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


@dataclass
class CudaCheck:
    """The step's GPU code path on fake CUDA tensors, everything but the backward (see `unison.plan.cuda_check`)."""

    host_syncs: list[HostSync]
    device_error: str | None    # a CPU tensor met a CUDA one: the error and where
    skipped: str | None = None  # why the check could not run


@dataclass
class PlanReport:
    cfg: TrainConfig
    gpu: GPU
    step: StepFigures
    per_image_bytes: float     # slope of the peak in the local batch (the linear fit)
    mfu: float
    cuda: CudaCheck
    images: int | None = None         # the data's training images; None: planned without --data
    extrapolated: str | None = None   # how a step of many micro-batches was simulated (`SIMULATED_MICRO_BATCHES`)
    budget_s: float | None = None     # --time-budget, in seconds
    image_size_given: bool = True     # False: no --image-size and no --data, the planner's default size

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
        per_step = self.cfg.batch_size * k
        return {
            "method": self.cfg.method, "backbone": resolve_backbone(str(self.cfg.backbone), self.cfg.image_size),
            "image_size": self.cfg.image_size, "world_size": world, "shard": self.cfg.distributed.shard, "amp": self.cfg.amp,
            "local_batch": s.local_batch, "global_batch": self.cfg.batch_size, "grad_sync_every": k,
            "images_per_step": per_step, "data": self.cfg.data if self.images is not None else None,
            "train_images": self.images,
            "steps_per_epoch": self.images // per_step if self.images else None,
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
            "estimate_images_per_s": per_step / step_s if step_s else None,
            **self._budget(step_s, per_step),
            "host_syncs": [str(h) for h in s.host_syncs],
            "host_syncs_unexplained": [str(h) for h in unexplained(s.host_syncs)],
            "cuda_path_skipped": self.cuda.skipped, "cuda_path_device_error": self.cuda.device_error,
            "cuda_path_host_syncs": [str(h) for h in self.cuda.host_syncs],
            "cuda_path_host_syncs_unexplained": [str(h) for h in unexplained(self.cuda.host_syncs)],
        }

    def _budget(self, step_s: float, per_step: int) -> dict[str, Any]:
        """What the estimated step time fits into --time-budget: steps (capped by --max-steps) and epochs."""
        if self.budget_s is None:
            return {}
        steps = int(self.budget_s // step_s) if step_s > 0 else 0
        if self.cfg.max_steps is not None:
            steps = min(steps, self.cfg.max_steps)
        return {"time_budget_s": self.budget_s, "estimate_steps_in_budget": steps,
                "estimate_epochs_in_budget": steps * per_step / self.images if self.images else None}

    def text(self) -> str:
        d = self.as_dict()
        micro = (f" x {d['grad_sync_every']:,} micro-batches per step ({d['micro_batches_simulated']})"
                 if d["grad_sync_every"] > 1 else "")
        if self.images is not None:
            data = (f"{d['train_images']:,} training images in --data {d['data']}, "
                    f"{_count(d['steps_per_epoch'] or 0, 'step')} per epoch")
        else:
            size = "" if self.image_size_given else f" (no --image-size: {d['image_size']} px)"
            data = (f"no --data: planned for the model and the image size alone{size}; give --data to check it and "
                    "count the steps per epoch")
        lines = [f"unison plan: {d['method']} on {d['backbone']} at {d['image_size']} px, {d['world_size']} ranks x "
                 f"{d['local_batch']} images{micro}, --shard {d['shard']}, --amp {d['amp']}, on {d['gpu']} "
                 f"(simulated); {data}", "per rank:"]
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
        if self.budget_s is not None:
            epochs = d["estimate_epochs_in_budget"]
            lines.append(f"  estimate for --time-budget {self.cfg.time_budget}: {d['estimate_steps_in_budget']:,} "
                         f"steps{'' if epochs is None else f' ({epochs:,.1f} epochs)'} at that step time; the run "
                         "measures its own step and plans from it (and leaves time for its final kNN and checkpoint)")
        lines.append(f"host synchronisations in the step: {len(d['host_syncs'])}")
        lines += explained_lines(self.step.host_syncs)
        lines.append("GPU code path on fake CUDA tensors (forward, optimizer, EMA; no backward): " + (
            f"not run ({self.cuda.skipped})" if self.cuda.skipped else
            f"DEVICE MISMATCH: {self.cuda.device_error}" if self.cuda.device_error else
            f"no device mismatch, {len(self.cuda.host_syncs)} host synchronisations"))
        lines += explained_lines(self.cuda.host_syncs)
        if not d["fits"]:
            lower = (f"lower --batch-size (at most {d['max_local_batch'] * d['world_size']:,} in all), or try"
                     if d["max_local_batch"] else "not one image per rank fits: try")
            lines.append(f"unison plan: this run does NOT fit {d['gpu']}: {lower} --shard full, --amp bf16 or "
                         "--activation-checkpointing (exit code 1)")
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
