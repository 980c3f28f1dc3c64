"""Communication report: bytes each worker hands to collectives per step, counted, against the ideal.

W real workers (gloo on CPU, NCCL on GPU) build each configuration with the production
step (`unison.training.step.build_run(..., metered_comm=True)`: backbone, method, SyncBN,
DDP, the method's recipe optimizer) and run a few steps on synthetic images inside `CommMeter`. ``metered=True`` gives
DDP the Python all-reduce hook, so gradient buckets go through ``dist.all_reduce`` and are
counted like everything else.

Categories (bytes this worker contributes per call, summed over a step):

* gradient all-reduce: calls made by DDP's comm hooks (plain, fp16, PowerSGD's P and Q and
  its uncompressed 1-D tensors), told apart by the calling module;
* other all-reduce: SyncBN statistics, the backward of autograd gathers, loss terms;
* all-gather (forward gathers of embeddings or keys), broadcast (DDP's per-step buffer
  broadcast when SyncBN is off, one-off state syncs), reduce-scatter.

Ideal = the gradient in bytes (trainable parameters that DDP synchronises x element size);
with no compression the counted gradient all-reduce equals it exactly, fp16 halves it.
Per-step figures are the mean over steps 3+ (PowerSGD sends plain gradients for its first
``start_iter = 2`` steps); the first step is reported separately for broadcasts, because
MoCo copies rank 0's key encoder and queue to every rank once there.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch

from unison.distributed.comm_meter import CommMeter

from .report import fmt_bytes, markdown_table, result_paths, write_csv

POWERSGD_START_ITER = 2
_HOOK_MODULE = "ddp_comm_hooks"   # torch/distributed/algorithms/ddp_comm_hooks/*.py


class GradTaggingMeter(CommMeter):
    """`CommMeter` that also counts, in ``grad_bytes``, the all-reduce bytes sent by DDP's comm hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_bytes = 0

    def _payload(self, name: str, args: tuple, kwargs: dict) -> int:
        n = super()._payload(name, args, kwargs)
        if name == "all_reduce" and _called_from_comm_hook():
            self.grad_bytes += n
        return n


def _called_from_comm_hook(depth: int = 8) -> bool:
    frame: FrameType | None = sys._getframe(2)   # skip _payload and CommMeter's wrapper
    for _ in range(depth):
        if frame is None:
            return False
        if _HOOK_MODULE in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@dataclass
class CommSpec:
    method: str
    compression: str = "none"     # none | fp16 | powersgd
    sync_batchnorm: bool = True
    gather: bool = True
    shared_queue: bool = True

    @property
    def label(self) -> str:
        parts = ["SyncBN + gather" if self.sync_batchnorm and self.gather else
                 "gather only" if self.gather else "SyncBN only" if self.sync_batchnorm else "local"]
        if self.method == "moco":
            parts.append("shared queue" if self.shared_queue else "per-rank queues")
        return ", ".join(parts)


def default_specs(methods: list[str]) -> list[CommSpec]:
    specs = []
    for m in methods:
        specs += [CommSpec(m, "none"), CommSpec(m, "fp16"), CommSpec(m, "powersgd"),
                  CommSpec(m, "none", sync_batchnorm=False)]
    return specs


def _step_bytes(meter: GradTaggingMeter) -> dict[str, int]:
    b = meter.bytes
    return {"grad_all_reduce": meter.grad_bytes, "other_all_reduce": b.get("all_reduce", 0) - meter.grad_bytes,
            "all_gather": b.get("all_gather", 0) + b.get("all_gather_into_tensor", 0),
            "broadcast": b.get("broadcast", 0) + b.get("_broadcast_coalesced", 0),
            "reduce_scatter": b.get("reduce_scatter_tensor", 0)}


def comm_worker(specs: list[dict[str, Any]], backbone_name: str, global_batch: int, image_size: int, steps: int,
                backend: str) -> list[dict[str, Any]]:
    """Run in every worker (see `unison.distributed.testing.run_in_workers`): per-spec, per-step counted bytes.

    Each configuration is the production step (`unison.training.step.build_run` with a metered DDP) on
    synthetic images: every rank trains on its own slice of each global batch."""
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.distributed import collectives as C
    from unison.distributed.tagging import rank_local_state_names
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    world = C.world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    results = []
    for raw in specs:
        spec = CommSpec(**raw)
        cfg = TrainConfig(method=spec.method, backbone=backbone_name, data="synthetic", batch_size=global_batch,
                          epochs=1, max_steps=steps, image_size=image_size, progress=False,
                          distributed=DistributedConfig(backend=backend, world_size=world,
                                                        sync_batchnorm=spec.sync_batchnorm,
                                                        gather_distributed=spec.gather,
                                                        grad_compression=spec.compression,
                                                        powersgd_start_iter=POWERSGD_START_ITER,
                                                        shared_queue=spec.shared_queue))
        run = build_run(cfg, device, train_set=synthetic_dataset(steps * global_batch, image_size).to(device),
                        metered_comm=True)
        ignored = set(rank_local_state_names(run.method))
        synced = [p for n, p in run.method.named_parameters() if p.requires_grad and n not in ignored]
        ideal = sum(p.numel() * p.element_size() for p in synced)
        per_step = []
        for batch in batches(run):
            with GradTaggingMeter() as meter:
                forward_backward(run, batch)
                optimizer_step(run, batch.step)
            per_step.append(_step_bytes(meter))
        queue = getattr(run.method, "queue", None)
        results.append({"spec": raw, "per_step": per_step, "ideal_bytes": ideal,
                        "trainable_params": sum(p.numel() for p in synced),
                        "element_size": synced[0].element_size() if synced else 0,
                        "queue_bytes": queue.numel() * queue.element_size() if isinstance(queue, torch.Tensor) else None})
    return results


def run_comm_report(specs: list[CommSpec], *, backbone: str, global_batch: int, image_size: int = 32,
                    workers: int = 2, steps: int = 4, backend: str = "gloo") -> list[dict[str, Any]]:
    """Counted bytes per configuration, from `workers` real processes; rank 0's figures, one row per spec."""
    from unison.distributed.testing import run_in_workers

    if steps <= POWERSGD_START_ITER:
        raise ValueError(f"steps must be > {POWERSGD_START_ITER} (PowerSGD compresses from step {POWERSGD_START_ITER + 1})")
    out = run_in_workers(comm_worker, workers, args=([asdict(s) for s in specs], backbone, global_batch, image_size,
                                                     steps, backend), backend=backend, timeout_s=600.0)
    rows = []
    for res in out[0]:
        steady = res["per_step"][POWERSGD_START_ITER:]
        mean = {k: sum(s[k] for s in steady) / len(steady) for k in steady[0]}
        spec = CommSpec(**res["spec"])
        rows.append({
            "method": spec.method, "config": spec.label, "compression": spec.compression, "workers": workers,
            "backbone": backbone, "global_batch": global_batch, "trainable_params": res["trainable_params"],
            "ideal_grad_bytes": res["ideal_bytes"], **{f"{k}_bytes": v for k, v in mean.items()},
            "grad_vs_ideal": mean["grad_all_reduce"] / res["ideal_bytes"] if res["ideal_bytes"] else None,
            "first_step_broadcast_bytes": res["per_step"][0]["broadcast"], "queue_bytes": res["queue_bytes"],
            "steps": steps, "per_step": res["per_step"],
        })
    return rows


def comm_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["Method", "Configuration", "Compression", "Ideal (gradient)", "Gradient all-reduce", "vs ideal",
               "Other all-reduce", "All-gather", "Broadcast", "Broadcast, step 1 only", "Queue (not broadcast)"]
    body = []
    for r in rows:
        body.append([r["method"], r["config"], r["compression"], fmt_bytes(r["ideal_grad_bytes"]),
                     fmt_bytes(r["grad_all_reduce_bytes"]),
                     "-" if r["grad_vs_ideal"] is None else f"{r['grad_vs_ideal']:.3f}",
                     fmt_bytes(r["other_all_reduce_bytes"]), fmt_bytes(r["all_gather_bytes"]),
                     fmt_bytes(r["broadcast_bytes"]), fmt_bytes(r["first_step_broadcast_bytes"]),
                     "-" if r["queue_bytes"] is None else fmt_bytes(r["queue_bytes"])])
    return markdown_table(headers, body)


def write_comm(rows: list[dict[str, Any]], out_dir, header: str = "") -> dict[str, Any]:
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = result_paths(out_dir, "comm")
    notes = ("\nBytes per step per worker, the mean over the steps after PowerSGD's start "
             f"(steps {POWERSGD_START_ITER + 1}+), counted by `CommMeter` as each worker hands them to a collective "
             "(a ring all-reduce moves about 2(W-1)/W times that over the wire). Ideal = trainable parameters "
             "synchronised by DDP x element size. \"Other all-reduce\": SyncBN's backward sums (2C per layer) and "
             "the backward of the autograd gathers; \"All-gather\": embeddings or keys, and SyncBN's forward "
             "statistics (2C+1 per layer). Broadcast per step is DDP's buffer broadcast (on when SyncBN is "
             "off); MoCo's queue and key encoder are rank-local state: copied from rank 0 once, at step 1, never again, "
             "while the keys' all-gather is counted every step.\n")
    paths["md"].write_text(header + comm_markdown(rows) + notes)
    write_csv(paths["csv"], [{k: v for k, v in r.items() if k != "per_step"} for r in rows])
    return paths
