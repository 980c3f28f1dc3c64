"""How long the step loop waits per checkpoint: asynchronous (snapshot + background write) against synchronous saves.

Runs the same short `unison.train` twice (``checkpoint_async`` on, then off) and reports, per mid-run checkpoint, the
time every rank spent in `save_run_checkpoint` (collecting optimizer, RNG and extra state, rank 0's snapshot or
whole write, the barrier): ``Summary.extra["checkpoint_wait_s"]``. The final checkpoint is excluded (the run waits
for it in both modes). The default model (resnet18, SGD momentum) gives checkpoints of about 90 MB.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_checkpoint.py
    PYTHONPATH=src .venv/bin/python benchmarks/bench_checkpoint.py --backbone small_cnn --world-size 1 --out /tmp/ck
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from unison.api import train
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.training.checkpoint import latest_checkpoint


def run(asynchronous: bool, args: argparse.Namespace, out: Path) -> dict:
    cfg = TrainConfig(backbone=args.backbone, batch_size=args.batch_size, subset=args.subset, val_subset=64, knn_k=5,
                      epochs=100, max_steps=args.steps, checkpoint_every=args.every, keep_checkpoints=2,
                      progress=False, checkpoint_async=asynchronous, out=str(out),
                      distributed=DistributedConfig(world_size=args.world_size))
    summary = train(cfg)
    waits = summary.extra["checkpoint_wait_s"][:-1]   # mid-run saves; the last one is the final, always waited for
    size_mb = latest_checkpoint(out).stat().st_size / 2**20
    return {"mode": "async" if asynchronous else "sync", "backbone": args.backbone, "world_size": args.world_size,
            "checkpoint_mb": round(size_mb, 1), "waits_s": waits, "median_wait_s": round(statistics.median(waits), 4),
            "train_time_s": round(summary.train_time_s, 2), "steps": summary.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--backbone", default="resnet18")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--subset", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    p.add_argument("--out", default=None, help="folder for the two runs (default: a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for asynchronous in (True, False):
            print(json.dumps(run(asynchronous, args, root / ("async" if asynchronous else "sync"))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
