"""The report of ``unison eval``: one row per protocol computed, with the labels it learnt from, its scores and,
where ``--from-scratch`` computed it, the same protocol from a randomly initialised backbone and the difference
(what pre-training bought). Printed, and written to ``OUT/eval.json`` (the whole result) and ``OUT/eval.md``
(the table); ``--json`` writes the same JSON elsewhere too.

Example of ``eval.md``::

    | protocol | labels | images | held-out | top-1 | top-5 | from scratch | gain |
    |---|---|---:|---:|---:|---:|---:|---:|
    | kNN (k=200, t=0.1) | 10% | 4,500 | 2,000 | 0.5312 |  | 0.3011 | +0.2301 |
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unison.config.fields import count

from .options import EvalOptions

MARKDOWN_TITLE = "# unison eval"
COLUMNS = ("protocol", "labels", "images", "held-out", "top-1", "top-5", "from scratch", "gain")


def fast_probe_name(opts: EvalOptions) -> str:
    return (f"linear probe, fast ({opts.linear_epochs} epochs of {opts.linear_optimizer} on frozen un-augmented "
            f"features, {opts.linear_norm} normalised)")


def full_name(r: dict[str, Any]) -> str:
    recipe = r["recipe"]
    what = "fine-tuning" if r["protocol"] == "fine-tune" else "linear, standard (frozen backbone, augmented views)"
    return f"{what}: {count(recipe['epochs'], 'epoch')} of {recipe['optimizer']}, batch {recipe['batch_size']}"


def rows(result: dict[str, Any], opts: EvalOptions) -> list[dict[str, Any]]:
    """The report's rows, in the order the protocols ran."""
    labels = result["labels"]["labels"]
    out: list[dict[str, Any]] = []
    scratch = result.get("scratch") or {}
    fast = [("knn", f"kNN (k={opts.knn_k}, t={opts.knn_t:g})", "knn_top1"),
            ("linear-fast", fast_probe_name(opts), "linear_top1")]
    for key, name, field in fast:
        if result.get(field) is None:
            continue
        out.append(_row(key, name, labels, result["train_images"], result["val_images"], result[field], None,
                        scratch.get(field), None))
    for r in result.get("full", []):
        if r["scratch"]:
            continue
        base = next((s for s in result["full"] if s["scratch"] and s["protocol"] == r["protocol"]), None)
        key = "fine-tune" if r["protocol"] == "fine-tune" else "linear-standard"
        out.append(_row(key, full_name(r), labels, r["train_images"], r["val_images"], r["top1"], r["top5"],
                        base["top1"] if base else None, base["top5"] if base else None))
    return out


def _row(key: str, name: str, labels: str, images: int, held_out: int, top1: float, top5: float | None,
         scratch_top1: float | None, scratch_top5: float | None) -> dict[str, Any]:
    return {"protocol": key, "name": name, "labels": labels, "train_images": images, "val_images": held_out,
            "top1": top1, "top5": top5, "scratch_top1": scratch_top1, "scratch_top5": scratch_top5,
            "gain_top1": None if scratch_top1 is None else top1 - scratch_top1}


def _cells(row: dict[str, Any]) -> list[str]:
    def num(x: float | None, signed: bool = False) -> str:
        return "" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")

    return [row["name"], row["labels"], f"{row['train_images']:,}", f"{row['val_images']:,}", num(row["top1"]),
            num(row["top5"]), num(row["scratch_top1"]), num(row["gain_top1"], signed=True)]


def markdown(result: dict[str, Any]) -> str:
    """``eval.md``: what was evaluated, on what, and the table."""
    labels = result["labels"]
    per_class = (f", {labels['per_class_min']:,} to {labels['per_class_max']:,} per class"
                 if labels["per_class_min"] is not None else "")
    drawn = (f"{labels['images']:,} of {labels['of']:,} images{per_class}, drawn with seed {labels['seed']}"
             if labels["labels"] != "all" else f"all {labels['of']:,} images{per_class}")
    lines = [f"{MARKDOWN_TITLE}: {result['method']} / {result['backbone']} at step {result['step']}", "",
             f"* checkpoint: `{result['checkpoint']}`", f"* data: `{result['data']}`, held out: `{result['val']}`",
             f"* labels: {labels['labels']} ({drawn})", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["report"]]
    return "\n".join(lines) + "\n"


def text_table(result: dict[str, Any]) -> list[str]:
    """The table as aligned lines for the terminal."""
    table = [list(COLUMNS)] + [_cells(r) for r in result["report"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    return ["  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in table]


def is_markdown_report(path: Path) -> bool:
    """`path` is an earlier ``eval.md`` (what a new report may replace)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(len(MARKDOWN_TITLE)) == MARKDOWN_TITLE
    except (OSError, UnicodeDecodeError):
        return False


def as_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=str) + "\n"
