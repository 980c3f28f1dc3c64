"""`Summary`: what a finished training run reports (`unison.train` returns it; ``summary.json`` holds it).

Example::

    summary = unison.train(TrainConfig(max_steps=20))
    print(summary.result_line())      # "simclr x2 workers, 20 steps, ...: kNN top-1 ... vs random init ..."
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from unison.config.fields import count


@dataclass
class Summary:
    method: str
    backbone: str
    data: str
    world_size: int
    steps: int
    epochs: float
    global_batch: int
    image_size: int
    train_images: int
    val_images: int
    final_loss: float
    knn_top1: float | None
    random_init_knn_top1: float | None
    train_time_s: float
    data_wait_fraction: float          # share of the step loop spent waiting for this rank's batches
    peak_memory_mib: list[float]       # per rank
    peak_memory_kind: str              # "cuda_max_allocated" or "peak_rss"
    out: str                           # the run directory
    loss_curve: list[tuple[int, float]] = field(default_factory=list)   # (step, loss) of every logged step
    log_times_s: list[float] = field(default_factory=list)   # seconds since the loop started, at each logged step
    mean: list[float] = field(default_factory=list)   # per-channel normalisation of the inputs (training set's)
    std: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    signals: dict[str, Any] = field(default_factory=dict)   # the last label-free signals, the collapse, their cost
    probe_top1: float | None = None    # the online linear probe's last logged accuracy (labelled data only)
    run_id: str | None = None          # the run's id (config.json's resolved.run_id, in each of its checkpoints)
    unreadable_images: int = 0         # training images skipped as unreadable (--on-corrupt skip), over all ranks
    init_knn_top1: float | None = None   # --init: the kNN of the starting weights (random_init_knn_top1: a random
                                         # encoder's, at the same seed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_dict(self) -> dict[str, Any]:
        """What ``summary.json`` holds: everything but the loss curve (that is in ``metrics.csv``)."""
        return {k: v for k, v in self.to_dict().items() if k not in ("loss_curve", "log_times_s")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def result_line(self, wall_s: float | None = None) -> str:
        """The line `unison train` ends with; `wall_s` its whole run time (start-up and evaluation included),
        else (the library's summary) the training loop's time."""
        took = f", {wall_s:.0f} s" if wall_s is not None else f", {self.train_time_s:.0f} s training"
        knn = "kNN not measured" if self.knn_top1 is None else f"kNN top-1 {self.knn_top1:.4f}"
        base = "" if self.random_init_knn_top1 is None else f" vs random init {self.random_init_knn_top1:.4f}"
        if self.init_knn_top1 is not None:   # continued pre-training: the number to beat is where it started
            base += f", vs --init weights {self.init_knn_top1:.4f}"
        rank = (f", RankMe {self.signals['rankme']:.1f} of {self.signals['rankme_max']:.0f}"
                if "rankme" in self.signals else "")
        collapse = self.signals.get("collapse")
        if collapse:
            rank += f", collapsed at step {collapse['step']}"
        stopped = " (stopped on collapse)" if self.signals.get("stopped_on_collapse") else ""
        if self.probe_top1 is not None:
            rank += f", online probe {self.probe_top1:.4f}"
        return (f"{self.method} x{count(self.world_size, 'worker')}, {count(self.steps, 'step')}{stopped}{took}: "
                f"{knn}{base}{rank} "
                f"(run dir {self.out})")


def peak_memory_mib(device: torch.device) -> float:
    """This worker's peak memory so far: the CUDA allocator's peak on GPU, the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM belongs to this process image; ru_maxrss can inherit the parent's peak across fork + exec
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


MMAP_THRESHOLD = 4 * 2**20   # bytes: larger blocks are mapped and unmapped, smaller ones come from the heap


def steady_heap() -> None:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` in this process (no-op without glibc).

    Why: glibc raises the threshold to the largest block freed so far (up to its DEFAULT_MMAP_THRESHOLD_MAX),
    after which blocks of that size come from the heap and stay there, fragmented, once freed: the more batches
    of another shape a phase allocates (the kNN of a larger reference set), the higher the peak, so a streamed
    run's memory would grow with its data (docs/benchmarks.md, "Does memory grow with the data?")."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)   # M_MMAP_THRESHOLD (glibc's malloc.h); it also fixes the trim threshold
    except (OSError, AttributeError):   # musl, macOS: no mallopt, or none of this behaviour
        pass
