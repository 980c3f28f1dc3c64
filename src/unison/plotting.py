"""Several runs' metrics on one page (loss, learning rate, kNN and probe accuracy, signals), each in its colour.

A RUN is a run directory (its ``metrics.csv``, and the random-initialisation kNN from its ``summary.json`` when
there is one) or a ``metrics.csv`` file. Every file read is a regular file of bounded size, decoded as UTF-8, and
every value a bounded number (`read_metrics`; past ±`MAX_PLOTTED` or not finite: a gap in its curve, as a
diverged loss): a damaged file is one line naming it, the line and the column, and so is a header that names a column
twice. A step logged twice (a resumed or re-formed run trains the steps after its checkpoint again) is drawn from its
later row (`unison.training.metrics.rows_by_step`). ``--out`` is a ``.png`` file; an existing one is replaced only
with ``--overwrite`` (every command's rule; ``--replace``, its earlier name, still works and says so), never a file
inside a RUN. It is written to a temporary sibling and renamed: a full disk leaves no
half-written ``--out``. The x-axis is steps, or epochs once a run spans one (``--x``).

Example::

    unison plot runs/simclr runs/byol --out compare.png
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from unison.config.fields import MAX_NUMBER_CHARS, count
from unison.config.parser import DeprecatedAlias
from unison.errors import ConfigError, DataError
from unison.paths import OVERWRITE_HELP, Input, check_output, write_error
from unison.training.metrics import rows_by_step
from unison.training.plots import X_AXES

MAX_METRICS_BYTES = 256 * 2**20   # far above what a 100k-step run logging every step writes
MAX_SUMMARY_BYTES = 1 << 20
MAX_RUNS = 20
MAX_LABEL_CHARS = 60
MAX_PLOTTED = 1e100   # larger magnitudes overflow matplotlib's axis arithmetic (a range of 2e308 is inf)
SOFTWARE = "unison plot"          # the PNG's Software field: how a refusal names an earlier plot of its own


def _read_bounded(path: Path, what: str, limit: int) -> str:
    """The UTF-8 text of regular file `path` (at most `limit` bytes); `DataError` naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise DataError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{what} {path} is not a regular file; give a run directory or its metrics.csv")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise DataError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise DataError(f"{what} {path} is past {limit >> 20} MiB; is it a unison metrics file?")
    try:
        return data.decode("utf-8-sig")   # a byte-order mark (a spreadsheet's "CSV UTF-8") is not part of the text
    except UnicodeDecodeError as exc:
        raise DataError(f"{what} {path} is not UTF-8 text (byte {exc.start}); is it a unison metrics file?") from None


def _number(text: str, where: str) -> float | None:
    if text == "":
        return None
    if len(text) > MAX_NUMBER_CHARS:
        raise DataError(f"{where}: a value of {len(text)} characters is not a number")
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{where}: {text[:20]!r} is not a number") from None
    # a diverged loss is a gap in the curve, not an axis to infinity; so is a finite value too large to draw
    return value if math.isfinite(value) and abs(value) <= MAX_PLOTTED else None


def _header_text(header: list[str] | None, shown: int = 6) -> str:
    """A header as one short line: its first `shown` names, each cut to 40 characters."""
    if not header:
        return "empty"
    names = ", ".join(name[:40] for name in header[:shown])
    return names + (f", ... ({len(header) - shown} more)" if len(header) > shown else "")


def read_metrics(path: Path) -> list[dict[str, float | None]]:
    """The rows of a ``metrics.csv`` (numbers, None where empty or not finite), one per step in step order, the later
    row of a step logged twice (`rows_by_step`); `DataError` if it is not one."""
    text = _read_bounded(path, "metrics file", MAX_METRICS_BYTES)
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, None)
        missing = [name for name in ("step", "epoch") if name not in (header or [])]
        if not header or missing:   # named as missing, so that a file holding one of the two is not told it has neither
            raise DataError(f"metrics file {path} has no {' and no '.join(map(repr, missing))} column (its header: "
                            f"{_header_text(header)}); is it a unison metrics.csv?")
        twice = next((name for k, name in enumerate(header) if name in header[:k]), None)
        if twice is not None:   # one of the two would be read without a word
            columns = [k + 1 for k, name in enumerate(header) if name == twice]
            raise DataError(f"metrics file {path} names the column {twice[:40]!r} twice (columns "
                            f"{', '.join(map(str, columns))}); a unison metrics.csv names each column once")
        rows = []
        for values in reader:
            where = f"metrics file {path} line {reader.line_num}"
            if len(values) != len(header):
                raise DataError(f"{where} has {len(values)} values for {len(header)} columns")
            rows.append({k: _number(v, f"{where}, column {k}") for k, v in zip(header, values)})
    except csv.Error as exc:   # a field past the csv module's limit (131,072 characters), a NUL byte, ...
        raise DataError(f"metrics file {path} line {reader.line_num} is not CSV ({exc}); is it a unison "
                        "metrics.csv?") from None
    return rows_by_step(rows)


def _baselines(run_dir: Path) -> dict[str, float]:
    """The baselines of ``summary.json``, if the run wrote one (a bad file is a DataError): the random-initialisation
    kNN, and a run started from ``--init`` its weights' kNN."""
    path = run_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        summary = json.loads(_read_bounded(path, "summary file", MAX_SUMMARY_BYTES))
        values = {"random init": summary.get("random_init_knn_top1"), "--init weights": summary.get("init_knn_top1")}
    except (ValueError, AttributeError):
        raise DataError(f"summary file {path} is not a JSON object; is it a unison summary.json?") from None
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and 0 <= v <= 1}


def run_metrics(run: str) -> tuple[Path, Path | None]:
    """(metrics.csv, the run directory or None) of a RUN argument."""
    p = Path(run)
    if p.is_dir():
        if not (p / "metrics.csv").exists():
            raise ConfigError(f"run {run} has no metrics.csv (a run with --logger none writes none); give a run "
                              "directory of unison train")
        return p / "metrics.csv", p
    if not p.exists():
        raise ConfigError(f"run {run} does not exist; give a run directory (--out of unison train) or its metrics.csv")
    return p, None


def _own_plot(path: Path) -> bool:
    """An earlier output of this command: a PNG whose Software field (near its start) names it."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and SOFTWARE.encode() in head


def plot_runs(runs: list[str], out: str, *, overwrite: bool = False, x_axis: str = "auto") -> Path:
    """Overlay `runs` into `out` (see the module docstring); an existing `out` is replaced only with `overwrite`."""
    from unison.training.metrics import COLLAPSE_STD_LINE
    from unison.training.plots import runs_figure

    if not runs:
        raise ConfigError("give at least one run directory, e.g. unison plot runs/a runs/b --out compare.png")
    if len(runs) > MAX_RUNS:
        raise ConfigError(f"{len(runs)} runs on one page would not be readable; give at most {MAX_RUNS}")
    if Path(out).suffix.lower() != ".png":
        raise ConfigError(f"--out {out} must end in .png, e.g. {Path(out).with_suffix('.png')}")
    found = [run_metrics(r) for r in runs]
    inputs = [Input(f"run {r}", d if d is not None else m, tree=d is not None) for r, (m, d) in zip(runs, found)]
    target = check_output(out, "--out", inputs=inputs, overwrite=overwrite, own=_own_plot,
                          own_text="a plot written by unison plot")
    page = [((r[-MAX_LABEL_CHARS:] if len(runs) > 1 else None), read_metrics(m), _baselines(d) if d else {})
            for r, (m, d) in zip(runs, found)]
    _save(runs_figure(page, collapse_std=COLLAPSE_STD_LINE, x_axis=x_axis), target)
    return target


def _save(fig: Any, target: Path) -> None:
    """`fig` as the PNG `target` (`save_figure`: nothing half-written is left); a failed write is one line."""
    from unison.training.plots import save_figure

    try:
        save_figure(fig, target, metadata={"Software": SOFTWARE})
    except OSError as exc:
        raise write_error(target, exc) from None


def cmd_plot(ns: argparse.Namespace) -> int:
    target = plot_runs(list(ns.runs or []), ns.out, overwrite=ns.overwrite, x_axis=ns.x)
    print(f"wrote {target}: {count(len(ns.runs), 'run')}, loss, learning rate, accuracy and the label-free signals")
    return 0


def add_subcommand(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("plot", help=help_text, description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", metavar="RUN", help="run directories (or their metrics.csv)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the page to write (a .png file)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--replace", action=DeprecatedAlias, use="--overwrite", dest="overwrite", help=argparse.SUPPRESS)
    p.add_argument("--x", choices=X_AXES, default="auto",
                   help="the x-axis: optimiser steps, epochs, or auto (epochs once a run spans one, else steps)")
    p.set_defaults(func=cmd_plot)

