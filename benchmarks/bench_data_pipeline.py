"""Throughput of the on-device augmentation pipeline (decode excluded).

Loads a dataset once (``../shared/data/cifar10/train`` by default, or ``digits``),
then times, per global batch: gathering the uint8 images of a global batch
(`global_batches`) and producing ALL views with `ViewAugmenter` (2 for simclr).
One image = one sample with all its views. Warm-up iterations are excluded.

    .venv/bin/python benchmarks/bench_data_pipeline.py                      # CIFAR-10 train folder, simclr, 32 px
    .venv/bin/python benchmarks/bench_data_pipeline.py --data digits --preset digits
    .venv/bin/python benchmarks/bench_data_pipeline.py --device cuda --json results.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from unison.config import TrainConfig
from unison.data import ViewAugmenter, global_batches, load_dataset

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/cifar10/train"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="'digits', 'cifar10' or an ImageFolder directory")
    ap.add_argument("--subset", type=int, default=None, help="load only this many images (class-balanced)")
    ap.add_argument("--preset", default="simclr")
    ap.add_argument("--image-size", type=int, default=None, help="view size (default: the stored image size)")
    ap.add_argument("--batch", type=int, default=256, help="global batch size")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timed blocks; the best and the median are reported")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", default=None, help="append one JSON line with the results to this file")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=TrainConfig().channels_last,
                    help="memory format of the timed training step (default: unison train's)")
    ap.add_argument("--train-step", default="small_cnn", metavar="BACKBONE",
                    help="also time a SimCLR training step with this backbone and report the ratio ('' = skip)")
    args = ap.parse_args(argv)

    if args.data not in ("digits", "cifar10") and not Path(args.data).is_dir():
        print(f"skipped: data folder not found at {args.data} (try --data digits)")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    t0 = time.perf_counter()
    ds = load_dataset(args.data, "train", subset=args.subset).to(device)
    load_s = time.perf_counter() - t0
    size = args.image_size or ds.image_size
    aug = ViewAugmenter(args.preset, size, ds.mean, ds.std)
    batches = global_batches(len(ds), args.batch, epoch=0, seed=0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(i: int) -> list[torch.Tensor]:
        idx = batches[i % len(batches)].to(device)
        return aug(ds.images[idx], idx, epoch=i // len(batches), seed=0)

    for i in range(args.warmup):
        step(i)
    sync()
    block_rates = []
    for r in range(args.repeats):
        t = time.perf_counter()
        for i in range(args.iters):
            step(args.warmup + r * args.iters + i)
        sync()
        block_rates.append(args.iters * args.batch / (time.perf_counter() - t))
    best, median = max(block_rates), sorted(block_rates)[len(block_rates) // 2]

    result = {
        "bench": "data_pipeline",
        "data": ds.name,
        "images_loaded": len(ds),
        "load_s": round(load_s, 2),
        "preset": args.preset,
        "view_sizes": aug.view_sizes,
        "global_batch": args.batch,
        "iters": args.iters,
        "repeats": args.repeats,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "images_per_s_best": round(best, 1),
        "images_per_s_median": round(median, 1),
        "ms_per_batch_median": round(1000 * args.batch / median, 2),
    }
    print(f"data {ds.name}: {len(ds)} images {tuple(ds.images.shape[1:])}, loaded in {load_s:.1f} s (not timed)")
    print(f"device {result['device']}, torch {torch.__version__}, {result['torch_threads']} torch threads")
    print(f"preset {args.preset}, views {aug.view_sizes}, global batch {args.batch}, "
          f"{args.repeats} x {args.iters} iterations after {args.warmup} warm-up")
    print(f"augmentation: {median:,.0f} images/s median, {best:,.0f} best "
          f"({result['ms_per_batch_median']} ms per global batch, all views)")
    if args.train_step:
        train_rate = _train_step_rate(args, step, sync, device)
        result["train_step_backbone"] = args.train_step
        result["train_step_images_per_s"] = round(train_rate, 1)
        result["pipeline_over_train_step"] = round(median / train_rate, 1)
        print(f"SimCLR training step ({args.train_step}, forward + backward + SGD on the same views): "
              f"{train_rate:,.0f} images/s; the pipeline delivers {median / train_rate:.1f}x that")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


def _train_step_rate(args, make_views, sync, device) -> float:
    """Images/s one SimCLR optimiser step of `unison train` consumes, on views made once beforehand (not timed)."""
    from unison.distributed.testing import run_in_workers

    return run_in_workers(_time_train_step, 1, args=(args, make_views(0), str(device)), backend="local")[0]


def _time_train_step(args, views: list[torch.Tensor], device_name: str) -> float:
    """The production step (`unison.training.step`) of one worker, timed on fixed views."""
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import Batch, build_run, forward_backward, optimizer_step

    device = torch.device(device_name)
    iters = max(3, args.iters // 5)
    cfg = TrainConfig(method="simclr", backbone=args.train_step, data="synthetic", batch_size=args.batch,
                      epochs=1, max_steps=iters + 2, channels_last=args.channels_last, progress=False,
                      distributed=DistributedConfig(backend="local", world_size=1))
    run = build_run(cfg, device, train_set=synthetic_dataset(args.batch, views[0].shape[-1]).to(device))
    if args.channels_last:   # as `unison train`'s batch iterator does by default
        views = [v.contiguous(memory_format=torch.channels_last) for v in views]
    indices = torch.arange(args.batch)

    def train_step(step: int) -> None:
        forward_backward(run, Batch(step, 0, 0, indices, views))
        optimizer_step(run, step)

    for step in range(2):
        train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for step in range(2, iters + 2):
        train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return iters * args.batch / (time.perf_counter() - t)


if __name__ == "__main__":
    sys.exit(main())
