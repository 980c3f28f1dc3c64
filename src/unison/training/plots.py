"""``plot.png``: one page per run (or several runs overlaid, ``unison plot``) from the rows of ``metrics.csv``.

Six panels against steps or epochs (`x_axis`; ``auto``: epochs once a run spans `EPOCH_AXIS_FROM` epochs,
else steps, so that a short run is not squashed into 0-0.007 of an epoch): the training loss, the learning
rate, accuracy (kNN dots, the online probe's line, the baselines as horizontal lines: the random-initialisation
kNN dashed, a run started from ``--init`` weights their kNN dash-dotted), RankMe, the embedding
std x sqrt(d) (1: spread uniformly over the sphere; the collapse threshold dashed) and alignment / uniformity.
Readable at any length: up to `FEW_POINTS` points each is a dot; a longer series is thinned to at most
`MAX_POINTS` bucket means, and a noisy one (the loss, the probe) is drawn faint with a moving average over it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FEW_POINTS = 30      # up to this many points, each is drawn with a marker (a run of one logged step is one dot)
MAX_POINTS = 1_000   # a longer series is thinned to this many bucket means (a 100k-step run logs 10k losses)
SMOOTH = 0.02        # moving-average window of noisy series: this share of the points (at least 1)
EPOCH_AXIS_FROM = 1.0   # x_axis "auto": epochs when the longest run reaches this many, steps below
X_AXES = ("auto", "step", "epoch")

Series = tuple[list[float], list[float]]
# A run's baselines, by name: "random init" (the random-initialisation kNN), "--init weights" (the kNN of the
# weights a continued pre-training started from); a bare number is the random-init kNN.
Baselines = Mapping[str, float | None] | float | None
BASELINE_STYLES = {"random init": "--", "--init weights": "-."}


def baselines_of(given: Baselines) -> dict[str, float]:
    """The named baselines of `given` (a bare number: the random-initialisation kNN), those measured only."""
    named = {"random init": given} if isinstance(given, (int, float)) else dict(given or {})
    return {k: float(v) for k, v in named.items() if v is not None}


def _series(rows: Sequence[dict[str, Any]], key: str, x: str) -> Series:
    pts = [(float(r[x]), float(r[key])) for r in rows if r.get(key) is not None and r.get(x) is not None]
    return [p for p, _ in pts], [y for _, y in pts]


def choose_x_axis(runs: Sequence[Sequence[dict[str, Any]]], x_axis: str = "auto") -> str:
    """``step`` or ``epoch``: `x_axis` if it names one, else by the longest run's span (`EPOCH_AXIS_FROM`)."""
    if x_axis != "auto":
        return x_axis
    epochs = [float(r["epoch"]) for rows in runs for r in rows if r.get("epoch") is not None]
    return "epoch" if epochs and max(epochs) >= EPOCH_AXIS_FROM else "step"


def text_label(label: str) -> str:
    """`label` drawn as written: ``$...$`` is not matplotlib mathtext (a run directory may be named so), and a
    leading ``_`` would hide it from the legend."""
    label = label.replace("$", r"\$")
    return "\u200b" + label if label.startswith("_") else label


def thin(xs: list[float], ys: list[float], limit: int = MAX_POINTS) -> Series:
    """At most `limit` points: the means of equal buckets of consecutive points (the shape of a long curve kept)."""
    n = len(xs)
    if n <= limit:
        return xs, ys
    out_x, out_y = [], []
    for b in range(limit):
        lo, hi = b * n // limit, (b + 1) * n // limit
        out_x.append(sum(xs[lo:hi]) / (hi - lo))
        out_y.append(sum(ys[lo:hi]) / (hi - lo))
    return out_x, out_y


def smooth(ys: list[float]) -> list[float]:
    """Centred moving average over `SMOOTH` of the points (prefix sums: linear in the length)."""
    w = max(1, int(len(ys) * SMOOTH)) // 2
    sums = [0.0]
    for y in ys:
        sums.append(sums[-1] + y)
    return [(sums[min(len(ys), i + w + 1)] - sums[max(0, i - w)]) / (min(len(ys), i + w + 1) - max(0, i - w))
            for i in range(len(ys))]


def _draw(ax: Any, s: Series, color: str, label: str | None, *, noisy: bool = False, style: str = "-") -> None:
    xs, ys = thin(*s)
    if not xs:
        return
    few = len(xs) <= FEW_POINTS
    if noisy and not few:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8, linestyle=style)
        ax.plot(xs, smooth(ys), color=color, label=label, linestyle=style)
    else:
        ax.plot(xs, ys, color=color, label=label, linestyle=style, marker="o" if few else None, markersize=4)


PANELS = (("loss", "training loss"), ("lr", "learning rate"), ("accuracy", "accuracy (kNN held-out, online probe)"),
          ("rankme", "RankMe (effective rank)"), ("emb_std", "embedding std x sqrt(d)"),
          ("align_uniform", "alignment (solid), uniformity (dashed)"))


def runs_figure(runs: Sequence[tuple[str | None, Sequence[dict[str, Any]], Baselines]],
                collapse_std: float | None = None, x_axis: str = "auto") -> Any:
    """The page of one run or several overlaid: `runs` holds (label or None, metrics rows, its `Baselines`);
    `x_axis`: ``step``, ``epoch`` or ``auto`` (`choose_x_axis`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(14, 7.5))
    axes = dict(zip((k for k, _ in PANELS), grid.flat))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    acc_values: list[float] = []
    x = choose_x_axis([rows for _, rows, _ in runs], x_axis)
    for i, (given, rows, baseline) in enumerate(runs):
        c = colours[i % len(colours)]
        label = text_label(given) if given else None
        _draw(axes["loss"], _series(rows, "loss", x), c, label, noisy=True)
        _draw(axes["lr"], _series(rows, "lr", x), c, label)
        knn, probe = _series(rows, "knn_top1", x), _series(rows, "probe_top1", x)
        name = f"{label}: " if label else ""
        _draw(axes["accuracy"], knn, c, f"{name}kNN" if knn[0] else None)
        _draw(axes["accuracy"], probe, c, f"{name}online probe" if probe[0] else None, noisy=True, style=":")
        named = baselines_of(baseline)
        for what, value in named.items():
            axes["accuracy"].axhline(value, color=c, linestyle=BASELINE_STYLES.get(what, ":"), alpha=0.7,
                                     label=f"{name}{what} ({value:.3f})")
        acc_values += knn[1] + probe[1] + list(named.values())
        _draw(axes["rankme"], _series(rows, "rankme", x), c, label)
        _draw(axes["emb_std"], _series(rows, "emb_std", x), c, label)
        _draw(axes["align_uniform"], _series(rows, "align", x), c, label)
        _draw(axes["align_uniform"], _series(rows, "uniform", x), c, None, style="--")
    if acc_values:   # a range around the values, inside [0, 1], so one point is not a flat empty axis
        low, high = min(acc_values), max(acc_values)
        pad = max(0.02, 0.15 * (high - low))
        axes["accuracy"].set_ylim(max(0.0, low - pad), min(1.0, high + pad))
    axes["emb_std"].axhline(1.0, color="tab:gray", linewidth=0.8, linestyle=":", label="uniform on the sphere")
    if collapse_std is not None:
        axes["emb_std"].axhline(collapse_std, color="tab:red", linewidth=0.8, linestyle="--",
                                label=f"collapse ({collapse_std})")
    axes["emb_std"].set_ylim(bottom=0)
    _finish(fig, axes, runs, x)
    return fig


def _finish(fig: Any, axes: dict[str, Any], runs: Sequence[tuple[str | None, Sequence[dict[str, Any]], Any]],
            x: str) -> None:
    xs = [float(r[x]) for _, rows, _ in runs for r in rows if r.get(x) is not None]
    for key, title in PANELS:
        ax = axes[key]
        ax.set(xlabel=x, title=title)
        if xs:   # every panel on the runs' range (the baselines span it)
            ax.set_xlim(0.0, max(xs) * 1.05 or 1.0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and (key in ("accuracy", "emb_std") or len(runs) > 1 and key == "loss"):
            ax.legend(loc="best", fontsize="small")
        if not ax.has_data():
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="tab:gray")
    if any(r.get("lr") for _, rows, _ in runs for r in rows):
        axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    fig.tight_layout()


def save_figure(fig: Any, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """`fig` as the PNG `path`, through a temporary sibling and a rename: a reader never sees half a page, and a
    failed write (a full disk) leaves neither a half-written `path` nor the temporary (the `OSError` is raised)."""
    import matplotlib.pyplot as plt

    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, dpi=100, format="png", metadata=metadata)
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        plt.close(fig)
    return target
