"""Memory per rank under --shard none | optimizer | full: parameters, gradients and optimizer state, measured.

Builds the step of `unison train` with `unison.training.step.build_run` (the same function the loop
and `unison check` use: DDP, DDP + ZeRO-1, or FSDP2 via `apply_fsdp`) in W real gloo workers on
synthetic images, runs one optimiser step with `forward_backward` / `optimizer_step`, and counts
on every rank the bytes of the tensors it holds:

* parameters: the local tensor of every parameter (an FSDP shard, or the whole replica);
* gradients: the same for ``p.grad``, read between the backward and the optimizer step;
* optimizer state: every tensor in the optimizer's state (ZeRO-1: only the owned parameters'),
  read after the step.

Shared storage is counted once. Peak RSS (``VmHWM``, Linux) is printed too: it also holds the
activations, the full model every rank builds before sharding, and the interpreter.

    .venv/bin/python benchmarks/fsdp_memory.py --world-sizes 1 2 4        # ViT-B/16, AdamW, SimCLR
    .venv/bin/python benchmarks/fsdp_memory.py --backbone small_cnn --image-size 32 --world-sizes 2

A markdown table goes to stdout (docs/benchmarks.md, "Full sharding").
"""

from __future__ import annotations

import argparse
import sys
import time

from unison.distributed.testing import run_in_workers

MIB = 2**20


def _bytes(tensors) -> int:
    from unison.distributed.dtensor import local_view
    from unison.parallel.zero import unique_bytes

    return unique_bytes(local_view(t) for t in tensors)   # views into one flat buffer count each


def _peak_rss_mib() -> float:
    """VmHWM: this process's peak resident set (ru_maxrss would carry the launcher's across exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _optimizer_bytes(optimizer) -> int:
    from unison.parallel.zero import ShardedOptimizer

    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.local_state_bytes()   # the owned parameters' state only
    return _bytes(v for s in optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage"))


def _work(args: dict) -> dict:
    import torch

    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.distributed import collectives as C
    from unison.training.step import batches, build_run, forward_backward, optimizer_step

    torch.set_num_threads(args["threads"])
    world = C.world_size()
    cfg = TrainConfig(method=args["method"], data="synthetic", backbone=args["backbone"], optimizer=args["optimizer"],
                      batch_size=args["local_batch"] * world, epochs=1, max_steps=1, threads=args["threads"],
                      progress=False, channels_last=False,
                      distributed=DistributedConfig(backend="gloo", world_size=world, shard=args["shard"]))
    run = build_run(cfg, torch.device("cpu"),
                    train_set=synthetic_dataset(args["local_batch"] * world, args["image_size"], 0))
    params = list(run.method.parameters())
    started = time.perf_counter()
    batch = next(batches(run))
    forward_backward(run, batch)
    grads = _bytes(p.grad for p in params if p.grad is not None)
    optimizer_step(run, batch.step)
    step_s = time.perf_counter() - started
    n_params = sum(p.numel() for p in params if p.requires_grad)   # global sizes (DTensor.numel is global)
    return {"rank": C.rank(), "params": _bytes(params), "grads": grads,
            "optimizer": _optimizer_bytes(run.optimizer), "rss_mib": _peak_rss_mib(), "step_s": step_s, "trainable": n_params}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--backbone", default="timm:vit_base_patch16_224")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--method", default="simclr")
    ap.add_argument("--optimizer", default="adamw", choices=("sgd", "lars", "adam", "adamw"))
    ap.add_argument("--local-batch", type=int, default=2, help="images per rank")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shards", nargs="+", default=["none", "optimizer", "full"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    print(f"| {args.backbone} ({args.method}, {args.optimizer}) | W | shard | parameters MiB | gradients MiB | "
          "optimizer state MiB | total MiB | total / (W=1, none) | peak RSS MiB (max rank) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for world in args.world_sizes:
        for shard in args.shards:
            spec = {**vars(args), "shard": shard}
            # always fresh worker processes (also at W=1, a gloo group of one), so each peak RSS is its own
            ranks = run_in_workers(_work, world, args=(spec,), backend="gloo", timeout_s=1800,
                                   threads_per_worker=args.threads)
            worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            total = worst["params"] + worst["grads"] + worst["optimizer"]
            base = base if base is not None or world != 1 or shard != "none" else total
            rel = f"{total / base:.2f}" if base else "-"
            print(f"| {worst['trainable'] / 1e6:.1f}M trainable | {world} | {shard} | {worst['params'] / MIB:.1f} | "
                  f"{worst['grads'] / MIB:.1f} | {worst['optimizer'] / MIB:.1f} | {total / MIB:.1f} | {rel} | "
                  f"{max(r['rss_mib'] for r in ranks):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
