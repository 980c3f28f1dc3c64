"""What a fine-tuning (or standard linear) evaluation leaves in its folder: a checkpoint to resume from, and its
metrics, one CSV row per epoch.

* ``checkpoint.pt``: the classifier's state (backbone, head, batch-norm statistics), the optimizer's state, the
  steps done, whether the run finished, and its `record` (the recipe, the data, the labels drawn, the checkpoint
  evaluated: everything that decides what the steps compute). Nothing else is needed to continue exactly: the
  data order, the views and the drop-path decisions are functions of (seed, epoch, index) and the learning rate a
  function of the step. Written by rank 0 under a temporary name, flushed and renamed (`save_state`), so an
  interrupted save leaves the previous checkpoint; read with ``weights_only=True`` (plain tensors and numbers).
  A resume whose record differs from the checkpoint's is refused, naming the first value that differs
  (`check_record`): continuing another recipe's steps would give a number that no single run computes.
* ``metrics.csv``: step, epoch, loss, train_top1 (on the augmented training views), lr, images_per_s and, on its
  last row, val_top1 and val_top5; a resumed run appends.

Hand-written rather than through `unison.training.checkpoint`: that is the training run's format (its method,
its configuration, its data order), a layer above this one; a classifier's state is a model and an optimizer.

Example::

    save_state(folder, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 120, "done": False,
                        "record": record})
    state = load_state(folder, device)        # None when there is none
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from unison.errors import CheckpointError, ConfigError
from unison.paths import write_error

__all__ = ["CHECKPOINT", "METRICS", "MetricsFile", "check_record", "load_state", "save_state"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.csv"
COLUMNS = ("step", "epoch", "loss", "train_top1", "lr", "images_per_s", "val_top1", "val_top5")


def save_state(folder: Path, state: dict[str, Any]) -> Path:
    """Write `state` to ``folder/checkpoint.pt`` atomically (a temporary file, flushed, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKPOINT
    fd, tmp = tempfile.mkstemp(prefix=f".{CHECKPOINT}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise write_error(path, e, "--out") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_state(folder: Path, device: torch.device) -> dict[str, Any] | None:
    """``folder/checkpoint.pt`` read onto `device`, or None when there is none."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:   # truncated, not a torch file, or holding objects beyond tensors and numbers
        raise CheckpointError(f"{path} cannot be read as an evaluation checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}); delete it, or run without "
                              "--resume to start the evaluation again") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "step", "record"} <= set(state):
        raise CheckpointError(f"{path} is not an evaluation checkpoint of unison eval; delete it, or run without "
                              "--resume")
    return state


def check_record(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """`ConfigError` naming the first value in which the run to resume differs from the one that saved `path`."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ConfigError(f"--resume: {path} was written by an evaluation with {key}={saved.get(key)!r}, this one "
                              f"has {key}={current.get(key)!r}; give the options it ran with, or run without --resume "
                              "to start again")


class MetricsFile:
    """``metrics.csv`` of one evaluation (rank 0 writes; a resumed one appends, a new one starts the file)."""

    def __init__(self, folder: Path, enabled: bool, append: bool):
        self.path, self.enabled = folder / METRICS, enabled
        if not enabled:
            return
        folder.mkdir(parents=True, exist_ok=True)
        fresh = not (append and self.path.is_file())
        try:
            with open(self.path, "w" if fresh else "a", newline="") as f:
                if fresh:
                    csv.writer(f).writerow(COLUMNS)
        except OSError as e:
            raise write_error(self.path, e, "--out") from None

    def row(self, **values: Any) -> None:
        if not self.enabled:
            return
        try:
            with open(self.path, "a", newline="") as f:
                csv.writer(f).writerow(["" if values.get(c) is None else _cell(values[c]) for c in COLUMNS])
        except OSError as e:
            raise write_error(self.path, e, "--out") from None


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
