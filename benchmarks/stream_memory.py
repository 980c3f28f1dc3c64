"""Peak resident memory per process of streamed training, `unison eval` and `unison embed` on data sets of
different sizes (issue 22: memory must not grow with the data).

Writes labelled ImageFolders of N JPEGs of random sizes (``--sides``, both sides drawn independently;
generated, cached under --root) for each N, then runs the same streamed training on each — `--data-mode
stream`, 2 gloo workers, 1 loader process each, the same number of steps, kNN on a 200-image held-out folder —
and prints every rank's peak RSS (VmHWM of the worker process; its loader processes are separate processes)
and the relative difference between the smallest and the largest data set. With ``--eval-embed`` it then
runs, each in a fresh process, ``unison eval`` of that run (its kNN and linear probe against the 200 held-out
images) and ``unison embed`` of the whole training folder with 2 processes, and prints their peak RSS too.

    PYTHONPATH=src python benchmarks/stream_memory.py --sizes 2000 20000 --steps 30
    PYTHONPATH=src python benchmarks/stream_memory.py --sizes 2000 20000 --sides 180 340 --image-size 64 \\
        --backbone small_cnn --steps 10 --eval-embed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig


def folder(root: Path, n: int, seed: int, sides: tuple[int, int]) -> Path:
    from unison.data.generated import write_image_folder

    tag = "" if tuple(sides) == (32, 64) else f"-{sides[0]}-{sides[1]}"
    path = root / (f"train-{n}{tag}" if seed else f"val-200{tag}")
    if not (path / ".complete").exists():
        t = time.perf_counter()
        write_image_folder(path, n, classes=10, sizes=tuple(sides), seed=seed, modes=(("RGB", "JPEG", ".jpg"),))
        (path / ".complete").write_text("")
        print(f"wrote {n} images to {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def _cli(*argv: str) -> str:
    """Run ``unison ARGV`` in a fresh process (its peak memory is its own); its standard output."""
    import unison

    env = {**os.environ, "PYTHONPATH": str(Path(unison.__file__).resolve().parents[1])}   # this unison, not another
    done = subprocess.run([sys.executable, "-m", "unison.cli", *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"unison {' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def eval_and_embed(run: str, data: Path, out: Path) -> dict[str, float]:
    """Peak RSS of `unison eval` (one process) and of `unison embed --world-size 2` (the larger of its two)."""
    _cli("eval", "--checkpoint", run, "--linear-epochs", "10", "--json", str(out / "eval.json"), "--overwrite")
    eval_peak = json.loads((out / "eval.json").read_text())["peak_memory_mib"]
    line = _cli("embed", "--checkpoint", run, "--data", str(data), "--out", str(out / "emb.npy"), "--overwrite",
                "--world-size", "2")
    embed_peaks = json.loads(line.split("peak memory per process (MiB): ")[1].split(")")[0])
    return {"eval_peak_rss_mib": eval_peak, "embed_peak_rss_mib": max(embed_peaks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sides", type=int, nargs=2, default=[32, 64], help="image side range in pixels")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--backbone", default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-embed", action="store_true", help="also measure unison eval and unison embed")
    p.add_argument("--root", default="/tmp/unison-stream-memory")
    p.add_argument("--out", default="runs/stream-memory")
    args = p.parse_args()
    from unison.api import train  # (unison.train is shadowed by the subpackage once it is imported)

    root = Path(args.root)
    val = folder(root, 200, 0, args.sides)
    rows = []
    for n in args.sizes:
        data = folder(root, n, n, args.sides)
        out = Path(f"{args.out}/n{n}")
        cfg = TrainConfig(data=str(data), val=str(val), data_mode="stream", loader_workers=1,
                          image_size=args.image_size, backbone=args.backbone, batch_size=args.batch_size, epochs=100,
                          max_steps=args.steps, progress=False, knn_k=20, out=str(out),
                          distributed=DistributedConfig(world_size=2))
        t = time.perf_counter()
        s = train(cfg)
        row = {"images": n, "peak_rss_mib": s.peak_memory_mib, "steps": s.steps, "knn_top1": s.knn_top1,
               "data_wait_fraction": round(s.data_wait_fraction, 3), "wall_s": round(time.perf_counter() - t)}
        if args.eval_embed:
            row.update(eval_and_embed(str(out), data, out))
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    lo, hi = rows[0], rows[-1]
    for rank in range(len(lo["peak_rss_mib"])):
        a, b = lo["peak_rss_mib"][rank], hi["peak_rss_mib"][rank]
        print(f"train rank {rank}: peak RSS {a:.1f} MiB at {lo['images']} images, {b:.1f} MiB at {hi['images']} "
              f"images: {100 * (b - a) / a:+.1f} %")
    for key in ("eval_peak_rss_mib", "embed_peak_rss_mib") if args.eval_embed else ():
        a, b = lo[key], hi[key]
        print(f"{key.split('_')[0]}: peak RSS {a:.1f} MiB at {lo['images']} images, {b:.1f} MiB at {hi['images']} "
              f"images: {100 * (b - a) / a:+.1f} %")


if __name__ == "__main__":
    main()
