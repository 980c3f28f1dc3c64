"""Writers shared by the benchmark parts: markdown and CSV tables, the table's PNG chart, a header.

Every part writes ``<name>.md`` (a self-contained section: what was measured, the exact
command, the machine, the load average at measurement time, the table, notes) and
``<name>.csv`` (one row per configuration, raw numbers, for plots or comparisons); `result_paths` names them, for
the writers and for the check that nothing there is replaced without ``--overwrite``.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The files each part writes into --out (`result_paths`), by kind; `bench all` adds report.md; the lab's parts
# name theirs (`benchmarks.lab.parts.RESULT_FILES`)
RESULT_FILES: dict[str, tuple[str, ...]] = {"table": ("md", "csv", "png"), "scaling": ("md", "csv"),
                                            "comm": ("md", "csv"), "data": ("md", "csv")}


def result_paths(out_dir: Path, part: str, kinds: Sequence[str] | None = None) -> dict[str, Path]:
    """The result files of `part` in `out_dir`, by kind (`kinds`, default `RESULT_FILES`'): ``{"md": out_dir /
    "table.md", ...}``."""
    if part == "all":
        return {"md": out_dir / "report.md"}
    return {kind: out_dir / f"{part}.{kind}" for kind in (RESULT_FILES[part] if kinds is None else kinds)}


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are str()-ed and '|' is escaped."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: _csv_value(v) for k, v in r.items()})


def _csv_value(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    return v


def section_header(title: str, what: str, command: str, machine: str, load_note: str) -> str:
    return (f"## {title}\n\n{what}\n\n"
            f"* command: `{command}`\n* machine: {machine}\n* load average (1/5/15 min): {load_note}\n\n")


def plot_table(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart of the distributed table: training time (annotated with the speed-up) and kNN accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    width = 0.8 / max(1, len(configs))
    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(11, 4.2))
    for j, conf in enumerate(configs):
        xs, times, accs, ups = [], [], [], []
        for i, m in enumerate(methods):
            r = next((r for r in rows if r["method"] == m and r["config"] == conf), None)
            if r is None:
                continue
            xs.append(i + (j - (len(configs) - 1) / 2) * width)
            times.append(r.get("train_time_s") or 0.0)
            accs.append(r.get("knn_top1") or 0.0)
            ups.append(r.get("speedup"))
        bars = ax_t.bar(xs, times, width, label=conf)
        for b, up in zip(bars, ups):
            if up is not None:
                ax_t.annotate(f"{up:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                              va="bottom", fontsize=8)
        ax_a.bar(xs, accs, width, label=conf)
    for ax, ylabel in ((ax_t, "training time (s)"), (ax_a, "kNN top-1 accuracy")):
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    ax_t.set_title("time (label: speed-up over 1 worker)", fontsize=10)
    ax_a.set_title("kNN accuracy", fontsize=10)
    handles, labels = ax_t.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(configs), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))   # room for the legend below the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)
