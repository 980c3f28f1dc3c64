"""What rank 0 records of a run as it goes: its metrics (``--logger``) and ``train.log`` (what the console showed).

Metrics: a CSV file and a PNG plot, optionally TensorBoard, Weights & Biases or MLflow (``--logger``).

``--logger`` (`TrainConfig.logger`):

* ``csv`` (default): ``metrics.csv``, one row per logged event with columns step, epoch, loss,
  lr, images_per_s, knn_top1, data_wait (the share of the logging window the step waited for
  data, on rank 0), the label-free signals rankme, emb_std, align, uniform
  (`unison.training.signals`), probe_top1 (the online probe) and world_size (the workers that trained the step:
  it changes where torchrun ``--nnodes MIN:MAX`` re-formed the group); empty where not measured. At the
  end ``plot.png`` (`unison.training.plots`): loss, learning rate, kNN / probe accuracy (the
  random-initialisation kNN dashed) and the signals against epochs.
* ``tensorboard``: the same, plus event files in ``<run dir>/tensorboard``
  (``pip install tensorboard``; ``tensorboard --logdir runs``).
* ``wandb``: the same, plus a Weights & Biases run (``pip install wandb``; the project is
  ``$WANDB_PROJECT`` or ``unison``, the run name the run directory's name, the configuration
  the run's). wandb is imported only when asked for.
* ``mlflow``: the same, plus an MLflow run (``pip install '.[mlflow]'``): in the tracking server
  ``$MLFLOW_TRACKING_URI`` names, else in the run's own store ``<run dir>/mlflow``; params the configuration, metrics
  the rows above, ``plot.png`` and ``summary.json`` artifacts at the end; a resumed run continues the same MLflow
  run (`unison.training.mlflow_run`). mlflow is imported only when asked for.
* ``none``: no metrics files (``summary.json``, ``config.json`` and ``train.log`` are still written).

A resumed run appends to ``metrics.csv``; a file with an older header is rewritten with the current
columns (earlier rows keep their values, new columns empty). The steps after the checkpoint it resumed from are
trained and logged again, so a step can have rows from two attempts: `rows_by_step` is the one rule of which counts
(the later), for every reader of the file (``plot.png``, ``unison plot``).

``train.log`` (`RunLog`, `append_run_log`): the progress bar is redrawn in place on the console, so the log holds its
content as lines instead: one per logged step (loss, learning rate, throughput), the kNN results, restarts,
warnings, and the line the command ended with (the result, or the error). Every line starts with the local time.
Rank 0 writes (the launching process writes the last line); a resumed run appends to the same file. Every run
writes it, whatever ``--logger`` says. Example (``runs/default/train.log``)::

    2025-01-01 12:00:00 simclr x2 workers on digits: 150 steps (30 epochs of 5), global batch 256, ...
    2025-01-01 12:00:01 step 1/150 (epoch 0.20): loss 5.4321, lr 0.0024, 812 img/s
    2025-01-01 12:00:30 simclr x2 workers, 150 steps, 31 s: kNN top-1 0.9000 vs random init 0.7600 (run dir runs/default)
"""

from __future__ import annotations

import contextlib
import csv
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

LOG_NAME = "train.log"
COLUMNS = ("step", "epoch", "loss", "lr", "images_per_s", "knn_top1", "data_wait", "rankme", "emb_std", "align",
           "uniform", "probe_top1", "world_size")


def rows_by_step(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, in step order, each column the value of the latest row of that step that has one.

    A step's events are rows of their own (its loss, its kNN, its signals); a resumed or re-formed run (a restart,
    torchrun ``--nnodes MIN:MAX``) logs the steps after its checkpoint again, below the first attempt's rows: the
    later row of a step counts (not a line going back from step 9 to 6). Rows without a step are left out."""
    merged: dict[float, dict[str, Any]] = {}
    for row in rows:
        step = row.get("step")
        if step is None:
            continue
        into = merged.setdefault(float(step), {})
        into.update({k: v for k, v in row.items() if v is not None or k not in into})
    return [merged[step] for step in sorted(merged)]


class MetricsLogger:
    """`error(path, oserror)`: what a failed write of ``metrics.csv`` or ``plot.png`` raises (a full disk: the
    training loop's one line, `unison.training.run_files`); None: the `OSError` itself."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, kind: str = "csv",
                 config: dict[str, Any] | None = None, error: Callable[[Path, OSError], Exception] | None = None):
        self.enabled = enabled and kind != "none"
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, Any]] = []
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: Any = None
        self.error = error
        if not self.enabled:
            return
        self.path = self.run_dir / "metrics.csv"
        with self._writing(self.path):
            self._open()
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        elif kind == "wandb":
            import wandb

            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "unison"), name=self.run_dir.name,
                                     dir=str(self.run_dir), config=config or {}, resume="allow")
        elif kind == "mlflow":
            from unison.training.mlflow_run import MLflowRun

            self._mlflow = MLflowRun(self.run_dir, config or {}, error)

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if self.error is None:
                raise
            raise self.error(path, e) from None

    def _open(self) -> None:
        if self.path.exists():  # resumed run: keep the earlier rows
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.rows = [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                             for row in reader]
                header = tuple(reader.fieldnames or ())
            if header and header != COLUMNS:  # written by another unison version: one header for all rows
                self._rewrite()
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        if self._file.tell() == 0:  # a resumed run whose file holds only the header must not get a second one
            self._writer.writeheader()

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS} for row in self.rows)
        tmp.replace(self.path)

    def log(self, **values: Any) -> None:
        if not self.enabled:
            return
        row = {k: values.get(k) for k in COLUMNS}
        self.rows.append(row)
        with self._writing(self.path):
            self._writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
            self._file.flush()
        scalars = {k: v for k, v in values.items() if k not in ("step", "epoch") and v is not None}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, int(values["step"]))
        if self._wandb is not None:
            self._wandb.log({**scalars, "epoch": values.get("epoch")}, step=int(values["step"]))
        if self._mlflow is not None:
            epoch = {"epoch": values["epoch"]} if values.get("epoch") is not None else {}
            self._mlflow.log(int(values["step"]), {**scalars, **epoch})

    def release(self) -> None:
        """Close the files without drawing the plot (a run that failed); safe after `close`."""
        if self.enabled and not self._file.closed:
            with contextlib.suppress(OSError):   # a full disk: the run's own error says so
                self._file.close()
            if self._tb is not None:
                self._tb.close()
        if self._mlflow is not None:
            self._mlflow.release()

    def close(self, random_init_knn_top1: float | None = None, init_knn_top1: float | None = None) -> None:
        if not self.enabled:
            return
        with self._writing(self.path):
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        with self._writing(self.run_dir / "plot.png"):
            plot_metrics(rows_by_step(self.rows), self.run_dir / "plot.png", random_init_knn_top1, init_knn_top1)
        if self._mlflow is not None:   # after the plot: it is one of the run's artifacts
            self._mlflow.close()


def metrics_figure(rows: list[dict[str, Any]], random_init_knn_top1: float | None = None,
                   init_knn_top1: float | None = None) -> Any:
    """The figure of ``plot.png`` (`unison.training.plots`): loss, learning rate, accuracy (the random-init kNN
    dashed, ``--init``'s weights' kNN dash-dotted), and the label-free signals, against epochs."""
    from unison.training.plots import runs_figure

    baselines = {"random init": random_init_knn_top1, "--init weights": init_knn_top1}
    return runs_figure([(None, rows, baselines)], collapse_std=COLLAPSE_STD_LINE)


COLLAPSE_STD_LINE = 0.05   # `unison.training.collapse.COLLAPSE_STD` (which imports this module), drawn on the plot


def plot_metrics(rows: list[dict[str, Any]], path: str | Path, random_init_knn_top1: float | None = None,
                 init_knn_top1: float | None = None) -> Path:
    from unison.training.plots import save_figure

    return save_figure(metrics_figure(rows, random_init_knn_top1, init_knn_top1), path)


# ---- train.log

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
