"""Where a training step's time goes: per-phase milliseconds and torch.profiler's top operators, per rank.

Builds the step of `unison train` with `unison.training.step.build_run` (the same function the
loop and `unison check` use) in W real gloo workers with one torch thread each (W=1: one
process), times the data (slice + augmentation), forward + backward and the optimizer step
over `--steps` steps, then
profiles `--profile-steps` more on every rank and prints rank 0's operator table. This is
how the 2-worker CPU step was found to spend most of its time in the element-wise ops of
the first GlobalBatchNorm (docs/benchmarks.md, "Why the numbers moved").

    .venv/bin/python benchmarks/profile_step.py --world-size 2
    .venv/bin/python benchmarks/profile_step.py --world-size 1 --threads 2 --no-channels-last

Timings are CPU wall clock; on a shared machine, compare runs made one after the other.
"""

from __future__ import annotations

import argparse
import sys
import time

from unison.config import TrainConfig
from unison.distributed.testing import run_in_workers


def _work(args: argparse.Namespace) -> dict:
    import torch

    from unison.config.distributed import DistributedConfig
    from unison.distributed import collectives as C
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    torch.set_num_threads(args.threads)
    world = C.world_size()
    total = 3 + args.steps + args.profile_steps
    cfg = TrainConfig(method=args.method, backbone=args.backbone, data=args.data, subset=args.subset,
                      batch_size=args.batch_size, epochs=total, max_steps=total, threads=args.threads,
                      channels_last=args.channels_last, progress=False,
                      distributed=DistributedConfig(backend="gloo" if world > 1 else "local", world_size=world,
                                                    sync_batchnorm=args.sync_batchnorm))
    run = build_run(cfg, torch.device("cpu"))   # the step of `unison train`, nothing rebuilt here
    stream = batches(run)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        batch = next(stream)   # this rank's slice, augmented (the data phase)
        t1 = time.perf_counter()
        forward_backward(run, batch)
        t2 = time.perf_counter()
        optimizer_step(run, batch.step)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for _ in range(3):  # warm-up
        step()
    phases = [0.0, 0.0, 0.0]
    started = time.perf_counter()
    for _ in range(args.steps):
        phases = [a + b for a, b in zip(phases, step())]
    elapsed = time.perf_counter() - started
    out = {"images_per_s": args.steps * args.batch_size / elapsed,
           **{name: 1000 * t / args.steps for name, t in zip(("data_ms", "forward_backward_ms", "optimizer_ms"),
                                                               phases)}}
    if args.profile_steps:  # every rank profiles, so their collectives keep meeting
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                step()
        out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    return out


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--method", default=defaults.method)
    ap.add_argument("--backbone", default=defaults.backbone)
    ap.add_argument("--data", default="../shared/data/cifar10/train")
    ap.add_argument("--subset", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=256, help="global batch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after 3 warm-up steps")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the timed ones (0: none)")
    ap.add_argument("--rows", type=int, default=20, help="operators in the profile table")
    ap.add_argument("--sync-batchnorm", action=argparse.BooleanOptionalAction,
                    default=defaults.distributed.sync_batchnorm)
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=defaults.channels_last)
    args = ap.parse_args(argv)
    if args.batch_size % args.world_size:
        ap.error(f"--batch-size {args.batch_size} must be divisible by --world-size {args.world_size}")
    if args.world_size == 1:
        results = run_in_workers(_work, 1, (args,), backend="local")
    else:
        results = run_in_workers(_work, args.world_size, (args,), timeout_s=600, threads_per_worker=args.threads)
    print(f"{args.method} / {args.backbone}, {args.world_size} worker(s) x {args.threads} thread(s), global batch "
          f"{args.batch_size}, SyncBN {args.sync_batchnorm}, channels_last {args.channels_last}")
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r['images_per_s']:.1f} img/s; per step: data + augmentation {r['data_ms']:.1f} ms, "
              f"forward + backward {r['forward_backward_ms']:.1f} ms, optimizer {r['optimizer_ms']:.1f} ms")
    if "table" in results[0]:
        print(f"rank 0, {args.profile_steps} profiled steps:\n{results[0]['table']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
