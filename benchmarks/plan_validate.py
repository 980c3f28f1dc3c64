"""`unison plan` against a measured CPU step: the validation table of docs/benchmarks.md ("unison plan").

One process: the plan of a CPU configuration (W=1, fake tensors) and the same step run for real (an in-process
gloo group of one), its second step tracked by the same `MemTracker`; FLOPs against `unison.bench.flops`.
tests/unit/plan/test_plan.py asserts the same comparison (5 % for state, 25 % for activations and peak).

    PYTHONPATH=src python benchmarks/plan_validate.py --method simclr --backbone resnet18 --image-size 32 --batch 8
"""

from __future__ import annotations

import argparse
import sys


def measured_step(cfg, image_size: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from unison.data.synthetic import synthetic_dataset
    from unison.plan import _device_snapshot, _tracker_class
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(2 * cfg.batch_size, image_size))
        stream = batches(run)
        forward_backward(run, next(stream))
        optimizer_step(run, 0)
        tracker = _tracker_class()()
        tracker.track_external(run.parallel_model, run.optimizer)
        with tracker:
            forward_backward(run, next(stream))
            grads = sum(p.grad.numel() * p.grad.element_size() for p in run.method.parameters() if p.grad is not None)
            optimizer_step(run, 1)
        snap = _device_snapshot(tracker.get_tracker_snapshot("peak"))
        opt = sum(v.numel() * v.element_size() for s in run.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))
        return {"parameters": sum(p.numel() * p.element_size() for p in run.method.parameters()), "gradients": grads,
                "optimizer state": opt, "activations at peak": snap.get("Activation", 0) + snap.get("Temp", 0),
                "peak": snap["Total"]}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from unison.bench.flops import training_step_flops
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.plan import MIB, simulate
    from unison.training.resolve import validate_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="simclr")
    ap.add_argument("--backbone", default="resnet18")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    cfg = validate_run(TrainConfig(method=args.method, data="synthetic", backbone=args.backbone,
                                   image_size=args.image_size, batch_size=args.batch, progress=False,
                                   channels_last=False, max_steps=2,
                                   distributed=DistributedConfig(backend="local", world_size=1)))
    plan = simulate(cfg)
    real = measured_step(cfg, args.image_size)
    planned = {"parameters": plan.params, "gradients": plan.grads, "optimizer state": plan.optimizer,
               "activations at peak": plan.activations, "peak": plan.peak}
    print(f"| {args.method}, {args.backbone}, {args.image_size} px, batch {args.batch} (CPU) | plan | measured | "
          "plan / measured |\n|---|---|---|---|")
    for key, value in planned.items():
        print(f"| {key} (MiB) | {value / MIB:.2f} | {real[key] / MIB:.2f} | {value / real[key]:.3f} |")
    flops = training_step_flops(args.method, args.backbone, args.batch, args.image_size)
    print(f"| matrix FLOPs per step (G) | {plan.flops / 1e9:.3f} | {flops / 1e9:.3f} (unison.bench.flops) | "
          f"{plan.flops / flops:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
