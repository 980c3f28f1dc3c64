"""The race's evaluation points on unison's side: a training hook (``UNISON_TRAIN_HOOKS=benchmarks.lab.race_hook``)
that saves the encoder every ``every_s`` seconds of the run's clock and after its last step.

``UNISON_RACE_SNAPSHOTS={"dir": ..., "every_s": ...}`` (JSON). Rank 0 writes ``<dir>/unison-NNN.pt``: the
backbone's state (on the CPU), its architecture, the step and the seconds since the run started (the clock
`unison.training.budget` counts the budget from). The copy costs the run the same as Lightly's side pays for its
own snapshots; the kNN of every snapshot runs after both sides have finished (`benchmarks.lab.race`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from unison.config import TrainConfig
from unison.training.hooks import StepEnd, TrainHook
from unison.training.step import Run

ENV = "UNISON_RACE_SNAPSHOTS"


def save_snapshot(directory: Path, side: str, index: int, backbone: torch.nn.Module, arch: str, step: int,
                  seconds: float) -> None:
    """One evaluation point of one side (both sides write them through here)."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in backbone.state_dict().items()}
    torch.save({"backbone": arch, "state": state, "step": step, "time_s": seconds},
               directory / f"{side}-{index:03d}.pt")


class SnapshotHook(TrainHook):
    def __init__(self, directory: Path, every_s: float) -> None:
        self.directory, self.every_s = directory, every_s
        self.started = time.perf_counter()
        self.next_s, self.index, self.step = every_s, 0, 0
        self.run: Run | None = None

    def start(self, run: Run, step: int) -> None:
        self.run, self.step = run, step

    def after_step(self, run: Run, end: StepEnd) -> None:
        self.step = end.step
        seconds = time.perf_counter() - self.started
        if seconds >= self.next_s and not end.last:
            self._save(run, seconds)
            while self.next_s <= seconds:
                self.next_s += self.every_s

    def close(self) -> None:   # after the last step: the final encoder
        if self.run is not None:
            self._save(self.run, time.perf_counter() - self.started)

    def _save(self, run: Run, seconds: float) -> None:
        save_snapshot(self.directory, "unison", self.index, run.method.backbone, run.resolved["backbone"], self.step,
                      seconds)
        self.index += 1


def train_hooks(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    spec: dict[str, Any] = json.loads(os.environ.get(ENV, "{}"))
    if rank != 0 or not spec:
        return []
    directory = Path(spec["dir"])
    directory.mkdir(parents=True, exist_ok=True)
    return [SnapshotHook(directory, float(spec["every_s"]))]
