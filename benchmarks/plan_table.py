"""`unison plan` over the configurations of docs/benchmarks.md: per-rank memory on H100s, simulated (estimates).

For each backbone x method x world size x --shard, `unison.plan.plan` runs the production step on a simulated
W-rank job (fake process group, fake tensors: nothing allocated) at --local-batch images per rank and 224 px,
and prints one markdown row: per-rank parameters + gradients + optimizer state, activations at the peak, the
peak, the largest local batch that fits the GPU (linear fit), matrix FLOPs and collective bytes per step.

    PYTHONPATH=src python benchmarks/plan_table.py                       # the whole table (slow: ~1 min a row)
    PYTHONPATH=src python benchmarks/plan_table.py --backbones resnet50 --methods simclr --worlds 8
"""

from __future__ import annotations

import argparse
import sys
import time

BACKBONES = {"ViT-B/16": "vit_base", "ViT-L/16": "vit_large", "ResNet-50": "resnet50"}
# Combinations that cannot run, and why: a row saying so instead of a figure.
UNSUPPORTED = {
    ("ResNet-50", "mae"): "MAE needs a ViT",
}


def row(backbone: str, method: str, world: int, shard: str, local: int, gpu: str, amp: str) -> str:
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.plan import MIB, plan, resolve_gpu
    from unison.training.resolve import validate_run

    cfg = TrainConfig(method=method, data="synthetic", backbone=BACKBONES[backbone], image_size=224,
                      batch_size=local * world, amp=amp, progress=False,
                      distributed=DistributedConfig(backend="nccl", world_size=world, shard=shard))
    # ImageNet-1k's training split (1,281,167 images): the steps per epoch of the data these backbones train on
    d = plan(validate_run(cfg, cuda_available=True), resolve_gpu(gpu), images=1_281_167).as_dict()
    state = d["parameters_mib"] + d["gradients_mib"] + d["optimizer_state_mib"]
    return (f"| {backbone} | {method} | {world} | {shard} | {local} | {state / 1024:.2f} | "
            f"{d['activations_at_peak_mib'] / 1024:.2f} | {d['peak_mib'] / 1024:.2f} | "
            f"{'yes' if d['fits'] else 'no'} | {d['max_local_batch']} | {d['matrix_flops_per_step'] / 1e12:.1f} | "
            f"{d['collective_bytes_per_step'] / MIB:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=list(BACKBONES))
    ap.add_argument("--methods", nargs="+", default=["dino", "simclr", "mae"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[8, 64])
    ap.add_argument("--shards", nargs="+", default=["none", "optimizer", "full"])
    ap.add_argument("--local-batch", type=int, default=32)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--amp", default="bf16")
    args = ap.parse_args(argv)
    print(f"| backbone | method | GPUs | shard | local batch | params + grads + optimizer GiB | activations GiB | "
          f"peak GiB | fits {args.gpu} | largest local batch | TFLOP / step / rank | collective MiB / step / rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for backbone in args.backbones:
        for method in args.methods:
            if (backbone, method) in UNSUPPORTED:
                print(f"| {backbone} | {method} | - | - | - | not run: {UNSUPPORTED[backbone, method]} |||||||")
                continue
            for world in args.worlds:
                for shard in args.shards:
                    started = time.perf_counter()
                    print(row(backbone, method, world, shard, args.local_batch, args.gpu, args.amp), flush=True)
                    print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
