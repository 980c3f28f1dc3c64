"""The measurement `unison plan` is validated against: the same configuration's step run for real on the CPU.

One process (an in-process gloo group of one): step 0 creates the optimizer's state, as in the plan; step 1 is
tracked by the plan's own `MemTracker`; the state it holds is counted from its tensors: the measurement the
plan's estimate (`unison.training.memory.model_state`) is checked against. Used by tests/plan/test_plan.py,
and by benchmarks/plan_validate.py and benchmarks/gpu_proof.py (as ``tests.helpers.plan_measure``, from the repository root).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from unison.config import TrainConfig
from unison.data.synthetic import synthetic_dataset
from unison.plan.tracking import device_snapshot, tracker_class
from unison.training.step import batches, build_run, forward_backward, optimizer_step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t   # FSDP2: this rank's shard of a DTensor


def grad_bytes(run: Any) -> int:
    """This rank's gradient bytes as held (FSDP2: its shards)."""
    return sum(_local(p.grad).numel() * p.grad.element_size() for p in run.method.parameters() if p.grad is not None)


def optimizer_bytes(run: Any) -> int:
    """This rank's optimizer state as held (ZeRO-1: the state of the parameters it owns; FSDP2: its shards)."""
    from unison.parallel.zero import ShardedOptimizer, unique_bytes

    if isinstance(run.optimizer, ShardedOptimizer):
        return run.optimizer.local_state_bytes()
    return unique_bytes(_local(v) for s in run.optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))


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
