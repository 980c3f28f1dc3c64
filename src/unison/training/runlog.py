"""``train.log``: what the console showed during a run, kept in the run directory.

The progress bar is redrawn in place on the console, so the log holds its content as lines
instead: one per logged step (loss, learning rate, throughput), the kNN results, restarts,
warnings, and the line the command ended with (the result, or the error). Every line starts
with the local time. Rank 0 writes (the launching process writes the last line); a resumed
run appends to the same file.

Example (``runs/default/train.log``)::

    2025-01-01 12:00:00 simclr x2 workers on digits: 150 steps (30 epochs of 5), global batch 256, ...
    2025-01-01 12:00:01 step 1/150 (epoch 0.20): loss 5.4321, lr 0.0024, 812 img/s
    2025-01-01 12:00:30 simclr x2 workers, 150 steps, 31 s: kNN top-1 0.9000 vs random init 0.7600 (run dir runs/default)
"""

from __future__ import annotations

import time
from pathlib import Path

LOG_NAME = "train.log"


def append_run_log(run_dir: str | Path, line: str, *, create: bool = False) -> None:
    """Append `line` (time-stamped) to ``run_dir/train.log``. Without `create`, a run directory that does not
    exist is left alone (an error before the run started must not create one). Never raises: the log must not
    end a run that the console still reports."""
    directory = Path(run_dir)
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        elif not directory.is_dir():
            return
        with open(directory / LOG_NAME, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line.rstrip()}\n")
    except OSError:
        pass


class RunLog:
    """``train.log`` of one rank: writes only where `enabled` (rank 0)."""

    def __init__(self, run_dir: str | Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled

    def line(self, text: str) -> None:
        if self.enabled:
            append_run_log(self.run_dir, text, create=True)
