"""The unison side of `unison bench lightly` alone: its steady-state images/s with extra `unison train` flags.

Runs `unison train` exactly as the bench's unison side does (`unison.bench.table.run_train`: fresh worker
processes; SimCLR, small CNN, 5,000 CIFAR-10 images, global batch 256, no warm-up epochs, no online probe, no
label-free signals) for STEPS steps, and prints the steady rate (after the first regular log, step 10) and the
warm-up, as the bench computes them. What it is for: a flag's effect on the step without Lightly's 4 minutes,
e.g. ``--compile`` (docs/benchmarks.md):

    .venv/bin/python benchmarks/steady_step.py 80
    .venv/bin/python benchmarks/steady_step.py 80 --compile

Run the two one after the other on an idle machine; compare only ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

from unison.bench.table import run_train

RUN_DIR = Path("/tmp/unison_steady_step")


def main(steps: str, extra: list[str]) -> None:
    argv = ["train", "--method", "simclr", "--backbone", "small_cnn", "--data", "../shared/data/cifar10/train",
            "--val", "../shared/data/cifar10/val", "--epochs", "1000", "--batch-size", "256", "--knn-k", "200",
            "--seed", "0", "--world-size", "1", "--no-progress", "--subset", "5000", "--val-subset", "1000",
            "--max-steps", steps, "--warmup-epochs", "0", "--no-online-probe", "--signal-images", "0",
            "--out", str(RUN_DIR), *extra]
    summary, wall = run_train(argv, RUN_DIR)
    curve, times = summary["loss_curve"], summary["log_times_s"]
    first = next(i for i, (step, _) in enumerate(curve) if step >= 10)
    steps_done, batch = summary["steps"], 256
    steady = (steps_done - curve[first][0]) * batch / (summary["train_time_s"] - times[first])
    print(f"steady img/s {steady:.1f}  all steps {steps_done * batch / summary['train_time_s']:.1f}  warm-up "
          f"{times[first]:.1f} s  wall {wall:.0f} s  kNN {summary['knn_top1']:.3f}  flags {extra}")


if __name__ == "__main__":   # the launcher's fork server imports this file: run only as a script
    main(sys.argv[1] if len(sys.argv) > 1 else "80", sys.argv[2:])
