"""Peak resident memory per rank of a streamed run, on data sets of different sizes (issue: real-scale data).

Writes labelled ImageFolders of N small JPEGs (32-64 px, generated, cached under --root) for
each N, then runs the same streamed training on each — `--data-mode stream`, 2 gloo workers,
1 loader process each, the same number of steps, kNN on a 200-image held-out folder — and
prints every rank's peak RSS (VmHWM of the worker process; its loader processes are separate
processes) and the relative difference between the smallest and the largest data set.

    PYTHONPATH=src python benchmarks/stream_memory.py --sizes 2000 20000 --steps 30
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig


def folder(root: Path, n: int, seed: int) -> Path:
    from unison.data.generated import write_image_folder

    path = root / f"train-{n}" if seed else root / "val-200"
    if not (path / ".complete").exists():
        t = time.perf_counter()
        write_image_folder(path, n, classes=10, sizes=(32, 64), seed=seed, modes=(("RGB", "JPEG", ".jpg"),))
        (path / ".complete").write_text("")
        print(f"wrote {n} images to {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--root", default="/tmp/unison-stream-memory")
    p.add_argument("--out", default="runs/stream-memory")
    args = p.parse_args()
    from unison.api import train  # (unison.train is shadowed by the subpackage once it is imported)

    root = Path(args.root)
    val = folder(root, 200, seed=0)
    rows = []
    for n in args.sizes:
        data = folder(root, n, seed=n)
        cfg = TrainConfig(data=str(data), val=str(val), data_mode="stream", loader_workers=1, image_size=32,
                          batch_size=64, epochs=100, max_steps=args.steps, progress=False, knn_k=20,
                          out=f"{args.out}/n{n}", distributed=DistributedConfig(world_size=2))
        t = time.perf_counter()
        s = train(cfg)
        rows.append({"images": n, "peak_rss_mib": s.peak_memory_mib, "steps": s.steps, "knn_top1": s.knn_top1,
                     "data_wait_fraction": round(s.data_wait_fraction, 3), "wall_s": round(time.perf_counter() - t)})
        print(json.dumps(rows[-1]), flush=True)
    lo, hi = rows[0], rows[-1]
    for rank in range(len(lo["peak_rss_mib"])):
        a, b = lo["peak_rss_mib"][rank], hi["peak_rss_mib"][rank]
        print(f"rank {rank}: peak RSS {a:.1f} MiB at {lo['images']} images, {b:.1f} MiB at {hi['images']} images: "
              f"{100 * (b - a) / a:+.1f} %")


if __name__ == "__main__":
    main()
