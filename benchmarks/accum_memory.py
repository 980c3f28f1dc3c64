"""Peak activation memory of one optimiser step under --grad-sync-every K, the same global batch for every K.

Builds the step of `unison train` (`unison.training.step.build_run`, one process, synthetic images) with
``batch_size = B / K`` and ``grad_sync_every = K`` and runs `accumulated_forward_backward`, in a fresh
process per (K, mode): memory on the first step, time on the second. Two measures of memory:

* saved activations: the peak bytes of the tensors autograd holds for backward (`saved_tensors_hooks`; each
  storage counted once while any saved reference to it is alive; parameters left out) - the memory that
  accumulation is for;
* peak RSS: ``VmHWM`` after the step minus the resident set just before it (glibc told to mmap every block
  over 64 KiB, so freed activations leave the resident set).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/accum_memory.py --ks 1 2 4 8
    .venv/bin/python benchmarks/accum_memory.py --method simclr --backbone resnet18 --image-size 32 --batch 128

A markdown table goes to stdout (docs/benchmarks.md, "Exact gradient accumulation").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 2**20


def _rss_mib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class SavedBytes:
    """Peak bytes of the storages autograd saves for backward, each counted once while saved."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.refs, self.now, self.peak = exclude, {}, 0, 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.exclude:
            return [t]
        if key not in self.refs:
            self.refs[key] = 0
            self.now += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        return _Tracked(self, key, t)   # released with the graph that holds it

    @staticmethod
    def unpack(packed):
        return packed[0] if isinstance(packed, list) else packed.t

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= nbytes


class _Tracked:
    def __init__(self, owner: SavedBytes, key: int, t):
        self.owner, self.key, self.t, self.nbytes = owner, key, t, t.untyped_storage().nbytes()

    def __del__(self):
        self.owner.release(self.key, self.nbytes)


def one(args: argparse.Namespace) -> dict:
    import torch

    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.distributed.env import init_distributed
    from unison.training.step import accumulated_forward_backward, build_run, optimizer_step, steps

    torch.set_num_threads(args.threads)
    k = args.k
    cfg = TrainConfig(method=args.method, backbone=args.backbone, data="synthetic", batch_size=args.batch // k,
                      max_steps=2, image_size=args.image_size, threads=args.threads, progress=False,
                      distributed=DistributedConfig(backend="local", world_size=1, grad_sync_every=k,
                                                    accumulation=args.accumulation))
    init_distributed(cfg.distributed)
    run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(2 * args.batch, args.image_size, 0))
    stream = steps(run)
    micro = next(stream)
    saved = SavedBytes({p.untyped_storage().data_ptr() for p in run.method.parameters()})
    before = _rss_mib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):   # memory: the first step
        accumulated_forward_backward(run, micro)
    rss_step = _rss_mib("VmHWM") - before
    optimizer_step(run, 0)
    micro = next(stream)
    started = time.perf_counter()                                              # time: the second
    accumulated_forward_backward(run, micro)
    seconds = time.perf_counter() - started
    return {"k": k, "accumulation": args.accumulation if k > 1 else "-", "exact": run.exact,
            "saved_mib": saved.peak / MIB, "rss_step_mib": rss_step, "step_s": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--method", default="simclr")
    p.add_argument("--backbone", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=128, help="global batch of the optimiser step (every K)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--independent", action="store_true", help="also --accumulation independent for K > 1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--accumulation", default="exact", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.k is not None:
        print(json.dumps(one(args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536")}
    rows = []
    modes = ["exact"] + (["independent"] if args.independent else [])
    for k in args.ks:
        for mode in modes if k > 1 else ["exact"]:
            cmd = [sys.executable, __file__, "--k", str(k), "--accumulation", mode, "--method", args.method,
                   "--backbone", args.backbone, "--image-size", str(args.image_size), "--batch", str(args.batch),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], file=sys.stderr, flush=True)
    base = rows[0]["saved_mib"]
    print("| K | accumulation | micro-batch | saved activations MiB | x of K=1 | step peak RSS MiB | step s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['accumulation']} | {args.batch // r['k']} | {r['saved_mib']:.1f} | "
              f"{r['saved_mib'] / base:.2f} | {r['rss_step_mib']:.0f} | {r['step_s']:.1f} |")


if __name__ == "__main__":
    main()
