"""The measurement `unison plan` is validated against: the same configuration's step run for real on the CPU.

One process (an in-process gloo group of one): step 0 creates the optimizer's state, as in the plan; step 1 is
tracked by the plan's own `MemTracker`. Used by tests/unit/plan/test_plan.py, and by benchmarks/plan_validate.py and
benchmarks/gpu_proof.py (as ``tests.helpers.plan_measure``, from the repository root).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from unison.config import TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.plan.tracking import device_snapshot, grad_bytes, optimizer_bytes, tracker_class
from unison.training.step import batches, build_run, forward_backward, optimizer_step


def measure_cpu_step(cfg: TrainConfig, image_size: int) -> dict[str, int]:
    """Bytes of one real CPU step of `cfg` (world size 1, synthetic images of `image_size`): parameters,
    gradients, optimizer state, activations at the peak and the peak."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(2 * cfg.batch_size, image_size))
        stream = batches(run)
        forward_backward(run, next(stream))
        optimizer_step(run, 0)
        tracker = tracker_class()()
        tracker.track_external(run.parallel_model, run.optimizer)
        with tracker:
            forward_backward(run, next(stream))
            grads = grad_bytes(run)
            optimizer_step(run, 1)
        snap = device_snapshot(tracker.get_tracker_snapshot("peak"))
        return {"parameters": sum(p.numel() * p.element_size() for p in run.method.parameters()), "gradients": grads,
                "optimizer state": optimizer_bytes(run),
                "activations at peak": snap.get("Activation", 0) + snap.get("Temp", 0),
                "peak": snap["Total"]}
    finally:
        dist.destroy_process_group()
