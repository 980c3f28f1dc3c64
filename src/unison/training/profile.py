"""``--profile-steps N``: where the time of a training step goes, recorded by ``torch.profiler``.

The record covers N whole iterations of the step loop after the first `SKIP_STEPS` optimiser steps (compile,
allocator growth and cuDNN's autotuning happen in those): the wait for data, the step, and the loop's own hooks
(logging, a kNN that falls due). Each rank writes, into ``<out>/profile/``:

    rank<R>-trace.json.gz   the Chrome trace (open it in Perfetto, https://ui.perfetto.dev, or chrome://tracing)
    rank<R>-ops.txt         the operators by their own time (device time on a GPU, host time otherwise)

and says in one line what a step cost: wall-clock milliseconds per step and, on a GPU, how much of that the
device spent in kernels. A device busy far below 100 % means the step waits on the host (kernel launches,
Python, synchronisations, data): CUDA graphs or ``--compile`` may pay there; a device busy near 100 % means the
kernels themselves are the cost.

The recorded steps run slower than the others (the profiler's own overhead), so a run that profiles is not a
speed measurement. A run shorter than ``SKIP_STEPS + N`` steps records its last N steps (all of them if it has
fewer, and says so).

Example::

    unison train --method simclr --data <folder> --max-steps 40 --profile-steps 20 --out runs/profiled
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unison.training.hooks import StepEnd, TrainHook
from unison.training.step import Run

SKIP_STEPS = 10   # optimiser steps before the record starts: compile, allocator and autotuning settle there
TOP_OPS = 30      # rows of the operator table


class ProfileHook(TrainHook):
    """Records optimiser steps ``first + 1 .. first + steps`` (1-based) of this rank with ``torch.profiler``."""

    def __init__(self, out: str | Path, steps: int, rank: int, say: Callable[[str], None] = print) -> None:
        self.folder, self.steps, self.rank, self.say = Path(out) / "profile", steps, rank, say
        self.first = SKIP_STEPS
        self.profiler: Any = None
        self.device = torch.device("cpu")
        self.started_at = 0.0
        self.recorded = 0

    def start(self, run: Run, step: int) -> None:
        # counted from where the run starts (a resumed run skips again); a short run records its last steps
        self.first = min(step + SKIP_STEPS, max(step, run.total_steps - self.steps))
        if self.first == step < run.total_steps:
            self._begin(run.device)

    def records(self, step: int) -> bool:
        """Whether optimiser step `step` (1-based, as `StepEnd.step`) is one this hook records: its time is the
        profiler's too (a ``--time-budget`` run does not plan from it, `unison.training.replan`)."""
        return self.first < step <= self.first + self.steps

    def after_step(self, run: Run, end: StepEnd) -> None:
        if self.profiler is None and self.recorded == 0 and end.step == self.first and not end.last:
            self._begin(run.device)
        elif self.profiler is not None:
            self.recorded += 1
            if self.recorded == self.steps or end.last or end.stop:
                self._finish()

    def close(self) -> None:
        if self.profiler is not None:   # the loop ended before the record did (a stop on time): keep what there is
            self._finish()

    def _begin(self, device: torch.device) -> None:
        self.device = device
        # kineto's own lines (profiler_start/stop, "gpuGetDeviceCount failed" on a machine without a GPU) tell the
        # user nothing: silent unless KINETO_LOG_LEVEL says otherwise (read when the profiler starts)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self.started_at = time.perf_counter()

    def _finish(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        wall_s = time.perf_counter() - self.started_at
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.folder / f"rank{self.rank}-trace.json.gz"))   # torch gzips a .gz
        sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=TOP_OPS)
        (self.folder / f"rank{self.rank}-ops.txt").write_text(table + "\n")
        if self.rank == 0:
            kernels_s = kernel_seconds(profiler.events()) if cuda else None
            self.say(summary_line(self.recorded, self.steps, wall_s, kernels_s, self.folder))


def kernel_seconds(events: Any) -> float:
    """The device's kernel time in `events` (a profiler's): the device-side events only, as torch's own table
    totals it (a host operator's device time is its kernels', which are events of their own)."""
    total_us = 0.0
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU and not getattr(event, "is_user_annotation", False):
            total_us += float(event.self_device_time_total)
    return total_us / 1e6


def summary_line(recorded: int, asked: int, wall_s: float, kernels_s: float | None, folder: Path) -> str:
    """The one line a profiled run says: ms per step, and on a GPU the share of it the device spent in kernels."""
    n = max(recorded, 1)
    line = f"profile: {recorded} steps, {1000 * wall_s / n:.1f} ms per step"
    if kernels_s is not None and wall_s > 0:
        line += f", device busy {100 * kernels_s / wall_s:.0f} % ({1000 * kernels_s / n:.1f} ms of kernels per step)"
    if recorded < asked:
        line += f" (asked for {asked}; the run ended first)"
    return line + f"; trace and operator table in {folder}"
