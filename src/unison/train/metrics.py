"""Run metrics: a CSV file, TensorBoard when installed, and a PNG plot at the end (rank 0 only).

``metrics.csv`` has one row per logged event with columns step, epoch, loss, lr,
images_per_s, knn_top1, data_wait (the share of the logging window the step waited for
data, on rank 0); empty where not measured. A resumed run whose file has an older header
rewrites it with the current columns (earlier rows keep their values, new columns empty). ``plot.png`` shows the training loss
and the kNN accuracy against epochs.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

COLUMNS = ("step", "epoch", "loss", "lr", "images_per_s", "knn_top1", "data_wait")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, Any]] = []
        self._tb = None
        if not enabled:
            return
        self.path = self.run_dir / "metrics.csv"
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
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional: pip install 'unison[tensorboard]'
            self._tb = None

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
        self._writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if k not in ("step", "epoch") and v is not None:
                    self._tb.add_scalar(k, v, int(values["step"]))

    def release(self) -> None:
        """Close the files without drawing the plot (a run that failed); safe after `close`."""
        if self.enabled and not self._file.closed:
            self._file.close()
            if self._tb is not None:
                self._tb.close()

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        plot_metrics(self.rows, self.run_dir / "plot.png")


def plot_metrics(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(r["epoch"], r["loss"]) for r in rows if r.get("loss") is not None]
    knn = [(r["epoch"], r["knn_top1"]) for r in rows if r.get("knn_top1") is not None]
    fig, (ax_loss, ax_knn) = plt.subplots(1, 2, figsize=(10, 3.8))
    if loss:
        ax_loss.plot(*zip(*loss), color="tab:blue")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    if knn:
        ax_knn.plot(*zip(*knn), marker="o", color="tab:green")
    ax_knn.set(xlabel="epoch", ylabel="kNN top-1", title="kNN accuracy (held-out)")
    for ax in (ax_loss, ax_knn):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
