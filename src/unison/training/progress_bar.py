"""The training progress bar on rank 0: tqdm's bar, with the run's latest metrics laid out to fit the terminal.

Why not tqdm's own postfix: at 100 columns or less its line (``desc: 30%|| 45/150 [00:10<00:25, 4.50step/s,
data=3%, img_s=1234, loss=...``) has no room left for the bar, which it then drops, and the end of the line is
cut off, metrics first. Here each redraw picks the richest layout that leaves the bar `MIN_BAR` columns: all
metrics and the step rate, then without the step rate (img/s says as much), then the metrics of lowest priority
dropped one by one (`LogHook` gives them in priority order: loss first). What does not fit is still in
``train.log`` and ``metrics.csv``. Not a terminal (a log file, a pipe): every field, one line per redraw.

Example::

    bar = progress_bar(total=150, initial=0, desc="simclr x2")
    bar.update(1)
    bar.show({"loss": "4.1234", "img/s": "1234", "data": "3%"})
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import IO, Any

from tqdm.auto import tqdm

__all__ = ["MIN_BAR", "RunProgress", "progress_bar"]

MIN_BAR = 10   # columns the bar keeps, whatever the width


def _metrics_text(metrics: Mapping[str, str]) -> str:
    """``, loss 4.1234, 1234 img/s``: "img/s" follows its number, every other name precedes its value."""
    parts = [f"{v} {k}" if k == "img/s" else f"{k} {v}" for k, v in metrics.items()]
    return "".join(", " + p.replace("{", "{{").replace("}", "}}") for p in parts)


def _layouts(metrics: Mapping[str, str]) -> list[str]:
    """tqdm ``bar_format`` strings, richest first."""
    head, counts = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} ", "[{elapsed}<{remaining}"
    keys = list(metrics)
    out = [head + counts + ", {rate_fmt}" + _metrics_text(metrics) + "]"]
    out += [head + counts + _metrics_text({k: metrics[k] for k in keys[:n]}) + "]" for n in range(len(keys), -1, -1)]
    return out + ["{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}", "{percentage:3.0f}%|{bar}|"]


def fit_layout(fields: dict[str, Any], metrics: Mapping[str, str]) -> str:
    """The richest layout whose text leaves the bar `MIN_BAR` of ``fields["ncols"]`` columns (tqdm's
    `format_dict`); the richest of all when the width is unknown."""
    layouts = _layouts(metrics)
    width = fields.get("ncols")
    if not width:
        return layouts[0]
    for layout in layouts:
        text = tqdm.format_meter(**{**fields, "bar_format": layout.replace("{bar}", ""), "ncols": None})
        if len(text) + MIN_BAR <= width:
            return layout
    return layouts[-1]


class RunProgress(tqdm):
    """tqdm whose every redraw lays out `metrics` (set with `show`) to fit the terminal's width (`fit_layout`)."""

    metrics: dict[str, str]

    @property
    def format_dict(self) -> dict[str, Any]:
        fields = super().format_dict
        fields["bar_format"] = fit_layout(fields, getattr(self, "metrics", {}))
        return fields

    def show(self, metrics: Mapping[str, str]) -> None:
        """The latest metrics, most important first (what a narrow terminal drops is at the end)."""
        self.metrics = dict(metrics)
        self.refresh()


def progress_bar(total: int, initial: int, desc: str, file: IO[str] | None = None) -> RunProgress:
    """The bar on rank 0 (standard error unless `file`), guarded by a thread lock instead of tqdm's default
    multiprocessing lock.

    Why: tqdm's default lock holds a multiprocessing semaphore, registered with the resource tracker the
    launcher shares with its workers; a worker ends with ``os._exit`` (`unison.distributed.env.exit_worker`),
    which never releases it, so every run ended with "resource_tracker: There appear to be 1 leaked semaphore
    objects". One process draws the bar, so a thread lock is all it needs."""
    RunProgress.set_lock(threading.RLock())
    return RunProgress(total=total, initial=initial, desc=desc, unit="step", mininterval=1.0, dynamic_ncols=True,
                       file=file)
