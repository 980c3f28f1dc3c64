"""Throughput of --shard full against --shard none at W workers, measured side by side in one invocation.

Each round launches W gloo workers twice, once per setting, alternating (none, full, none, full,
...), so both see the same machine load; every launch builds the step of `unison train` with
`unison.training.step.build_run` (DDP, or FSDP2 via `apply_fsdp`) on synthetic images and times
`--steps` optimiser steps (`forward_backward` + `optimizer_step`, data included) after
`--warmup` steps. Per round the ratio full / none of the images per second; the median over
rounds is the figure. Also the CPU time of a step summed over the ranks (``process_time``, gloo's
threads included), which other processes on a loaded machine disturb less than wall time. The CPU
model and the load average before each launch are printed.

    .venv/bin/python benchmarks/fsdp_throughput.py                                   # small CNN, 32 px
    .venv/bin/python benchmarks/fsdp_throughput.py --backbone timm:vit_tiny_patch16_224 --image-size 224 \\
        --global-batch 8 --steps 4

On a GPU machine pass --device cuda (NCCL).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from unison.bench.config import cpu_model, format_load, loadavg
from unison.distributed.testing import run_in_workers


def _work(args: dict) -> dict:
    import torch

    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.distributed import collectives as C
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    torch.set_num_threads(args["threads"])
    world = C.world_size()
    steps = args["warmup"] + args["steps"]
    device = torch.device("cuda", torch.cuda.current_device()) if args["device"] == "cuda" else torch.device("cpu")
    cfg = TrainConfig(method=args["method"], data="synthetic", backbone=args["backbone"],
                      batch_size=args["global_batch"], epochs=1, max_steps=steps, threads=args["threads"],
                      progress=False, amp=args["amp"],
                      distributed=DistributedConfig(backend=args["backend"] if world > 1 else "local",
                                                    world_size=world, shard=args["shard"]))
    run = build_run(cfg, device, train_set=synthetic_dataset(args["global_batch"] * steps, args["image_size"], 0))
    times, cpu = [], []
    started, cpu_started = time.perf_counter(), time.process_time()
    for batch in batches(run):
        forward_backward(run, batch)
        optimizer_step(run, batch.step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        now, cpu_now = time.perf_counter(), time.process_time()
        times.append(now - started)
        cpu.append(cpu_now - cpu_started)
        started, cpu_started = now, cpu_now
    return {"step_s": times[args["warmup"]:], "cpu_s": cpu[args["warmup"]:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--backbone", default="small_cnn")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--method", default="simclr")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--amp", default="none", choices=("none", "bf16"))
    args = ap.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"# {cpu_model()}; W={args.world_size} {backend} workers, {args.threads} thread(s) each; {args.method} "
          f"{args.backbone} {args.image_size} px, global batch {args.global_batch}, {args.steps} timed steps "
          f"after {args.warmup}")
    print("| round | shard | load (1/5/15 min) before | median step s | images/s | CPU s per step (all ranks) |")
    print("|---|---|---|---|---|---|")
    ratios, cpu_ratios = [], []
    for r in range(args.rounds):
        ips, cpu = {}, {}
        for shard in ("none", "full"):
            load = format_load(loadavg())
            spec = {**vars(args), "shard": shard, "backend": backend}
            ranks = run_in_workers(_work, args.world_size, args=(spec,), backend=backend if args.world_size > 1
                                   else "local", timeout_s=1800, threads_per_worker=args.threads)
            step_s = statistics.median(max(t) for t in zip(*(rk["step_s"] for rk in ranks)))   # slowest rank
            ips[shard] = args.global_batch / step_s
            cpu[shard] = statistics.median(sum(c) for c in zip(*(rk["cpu_s"] for rk in ranks)))
            print(f"| {r + 1} | {shard} | {load} | {step_s:.3f} | {ips[shard]:.1f} | {cpu[shard]:.3f} |", flush=True)
        ratios.append(ips["full"] / ips["none"])
        cpu_ratios.append(cpu["full"] / cpu["none"])
    print(f"\nthroughput full / none per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}")
    print(f"CPU time per step full / none per round: {', '.join(f'{x:.2f}' for x in cpu_ratios)}; "
          f"median {statistics.median(cpu_ratios):.2f} (less sensitive to other load than wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
