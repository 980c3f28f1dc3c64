"""Benchmarks: `unison bench` measures what the distributed machinery costs and what it buys.

Parts (each writes markdown + CSV, the table also a PNG, into ``runs/bench/<preset>``):

* ``table`` (`unison.bench.table`): Lightly's distributed table (method, kNN accuracy,
  workers, time, speed-up over 1 worker, peak memory per worker) for 1 worker, W workers
  with SyncBN + gather and W workers with gather only, each a real ``unison train`` run.
* ``comm`` (`unison.bench.comm`): bytes all-reduced / gathered / broadcast per step per
  worker, counted by `CommMeter`, against the gradient size; no compression, fp16, PowerSGD;
  MoCo's shared queue (never broadcast).
* ``scaling``: images/s of W workers x 1 thread vs 1 worker x 1 thread, same global batch.
* ``data`` (`unison.bench.data_loader`): images/s of the streaming loader at 224 px against the JPEG decode
  limit and other loaders, the same number of loader processes.

The peer comparisons, ``lightly`` (each method side by side with Lightly SSL's documented pipeline) and ``race``
(unison and Lightly's SimCLR at equal wall-clock time), are no part of this package: they are the lab,
``benchmarks/lab`` of the repository, which `unison.bench.commands` declares and runs from a clone
(`unison.bench.lab` finds it; without it, they refuse in one line).

Presets (`unison.bench.config.PRESETS`): ``cpu`` fits a 2-core machine in minutes;
``gpu`` is Lightly's protocol (ResNet-18, CIFAR-10, batch 512, k=200). Why a benchmark
module inside the library: the numbers in docs/benchmarks.md must be reproducible by one
command on any machine, with the machine and its load recorded beside them.
"""

from .config import PRESETS, BenchConfig

__all__ = ["PRESETS", "BenchConfig"]
