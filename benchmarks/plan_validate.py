"""`unison plan` against a measured CPU step: the validation table of docs/benchmarks.md ("unison plan").

One process: the plan of a CPU configuration (W=1, fake tensors) and the same step run for real (an in-process
gloo group of one), its second step tracked by the same `MemTracker`; FLOPs against `unison.bench.flops`.
tests/plan/test_plan.py asserts the same comparison (5 % for state, 25 % for activations and peak).

    PYTHONPATH=src python benchmarks/plan_validate.py --method simclr --backbone resnet18 --image-size 32 --batch 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # tests.helpers, as from the repository root


def main(argv: list[str] | None = None) -> int:
    from tests.helpers.plan_measure import measure_cpu_step
    from unison.bench.flops import training_step_flops
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.plan import MIB, simulate
    from unison.training.resolve import validate_run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
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
    real = measure_cpu_step(cfg, args.image_size)
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
