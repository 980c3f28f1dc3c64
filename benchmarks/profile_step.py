"""Where a training step's time goes: per-phase milliseconds and torch.profiler's top operators, per rank.

Builds the step of `unison train` (method, backbone, the recipe's augmentation, SyncBN and
DDP as configured) in W real gloo workers with one torch thread each (W=1: one process),
times augmentation, forward, backward and the optimizer step over `--steps` steps, then
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

    from unison.data.augment import ViewAugmenter
    from unison.data.datasets import load_dataset
    from unison.data.random import global_batches
    from unison.distributed import collectives as C
    from unison.distributed.config import DistributedConfig
    from unison.distributed.ddp import wrap_ddp
    from unison.distributed.sync_batchnorm import convert_sync_batchnorm
    from unison.methods import get_method
    from unison.models.backbones import build_backbone

    torch.set_num_threads(args.threads)
    world, device = C.world_size(), torch.device("cpu")
    data = load_dataset(args.data, "train", subset=args.subset, seed=0)
    method_cls = get_method(args.method)
    augment = ViewAugmenter(method_cls.recipe.for_data(args.data).augmentation, data.images.shape[-1], data.mean,
                            data.std)
    backbone, feature_dim = build_backbone(args.backbone)
    model = method_cls(backbone, feature_dim, method_cls.Params(), steps_total=args.steps + args.profile_steps + 3)
    if args.sync_batchnorm:
        model = convert_sync_batchnorm(model, device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    step_fn = model
    if world > 1:
        step_fn = wrap_ddp(model, DistributedConfig(backend="gloo", world_size=world,
                                                    sync_batchnorm=args.sync_batchnorm), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rows = C.local_slice(args.batch_size)
    batches = global_batches(len(data), args.batch_size, 0, 0)

    def step(i: int) -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        idx = batches[i % len(batches)][rows]
        views = augment(data.images[idx], idx, epoch=0, seed=0)
        if args.channels_last:
            views = [v.contiguous(memory_format=torch.channels_last) for v in views]
        t1 = time.perf_counter()
        loss = step_fn(views)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

    for i in range(3):  # warm-up
        step(i)
    phases = [0.0, 0.0, 0.0, 0.0]
    started = time.perf_counter()
    for i in range(args.steps):
        phases = [a + b for a, b in zip(phases, step(i))]
    elapsed = time.perf_counter() - started
    out = {"images_per_s": args.steps * args.batch_size / elapsed,
           **{name: 1000 * t / args.steps for name, t in zip(("augment_ms", "forward_ms", "backward_ms",
                                                               "optimizer_ms"), phases)}}
    if args.profile_steps:  # every rank profiles, so their collectives keep meeting
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.profile_steps):
                step(i)
        out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    return out


def main(argv: list[str] | None = None) -> int:
    defaults = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        print(f"rank {rank}: {r['images_per_s']:.1f} img/s; per step: augment {r['augment_ms']:.1f} ms, forward "
              f"{r['forward_ms']:.1f} ms, backward {r['backward_ms']:.1f} ms, optimizer {r['optimizer_ms']:.1f} ms")
    if "table" in results[0]:
        print(f"rank 0, {args.profile_steps} profiled steps:\n{results[0]['table']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
