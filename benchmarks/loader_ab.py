"""A/B of unison's streaming loader between two source trees, in images per CPU-second (the per-core rate).

Run it once per tree, alternately, in one command, on the same images (e.g. those `unison bench data`
generated), so that both see the same machine and load::

    for rep in 1 2; do
      python benchmarks/loader_ab.py src runs/bench/data-jpegs-512 now
      python benchmarks/loader_ab.py /tmp/base/src runs/bench/data-jpegs-512 base   # git archive <commit> src
    done

Each run times, with 2 loader processes and 1 torch thread, 8 batches of 64 SimCLR 224 px views after 2
warm-up ones: CPU only (colour ops in the loader processes), then the loader's part alone (uint8 crops).
CPU time: user + system of this process and its loader processes, from /proc (Linux).
"""

from __future__ import annotations

import os
import sys
import time


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every process below it (as `unison bench data`)."""
    tick, total, todo = os.sysconf("SC_CLK_TCK"), 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def main(src: str, folder: str, label: str) -> None:
    sys.path.insert(0, os.path.abspath(src))
    import torch

    from unison.data.augment import ViewAugmenter
    from unison.data.catalog import open_catalog
    from unison.data.stream import StreamingBatches

    torch.set_num_threads(1)
    for crops_only in (False, True):
        source = StreamingBatches(open_catalog(folder), ViewAugmenter("simclr", 224, (0.485, 0.456, 0.406),
                                                                      (0.229, 0.224, 0.225)),
                                  64, seed=0, device=torch.device("cpu"), loader_workers=2)
        if crops_only:
            source.decoder.finish = False
            it = iter(job["crops"] for job in source.loader(0))
        else:
            it = iter(views for _, _, views in source.iter_from(0))
        for _ in range(2):
            next(it)
        cpu, started = cpu_seconds(), time.perf_counter()
        for _ in range(8):
            next(it)
        wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        load = open("/proc/loadavg").read().split()[:3]
        print(f"{label} {'loader only (crops)' if crops_only else 'CPU only'}: {512 / wall:.1f} images/s, "
              f"{512 / cpu:.1f} per CPU-second, load {' '.join(load)}", flush=True)
        del it, source


if __name__ == "__main__":
    main(*sys.argv[1:4])
