"""The report of `unison bench lightly` (`benchmarks.lab.lightly_compare` measures): one row per method, seed and
side, and per method the kNN difference unison - Lightly (judged against the seeds' spread when there are two or
more a side), the throughput ratio and a note when a side's warm-up makes its all-steps rate mislead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unison.bench.report import fmt_duration, markdown_table, write_csv
from unison.bench.table import load_pair

from .parts import result_paths

WARMUP_SHARE = 0.05   # a side's warm-up above this share of its time: the all-steps rate understates it


def lightly_markdown(rows: list[dict[str, Any]]) -> str:
    steady_from = next((r.get("steady_from_step") for r in rows if r.get("steady_from_step")), None)
    headers = ["Method", "Seed", "Side", "Version", "Pipeline", "Threads", "Loader workers", "Steps x batch", "Training time",
               "Warm-up", f"img/s (steady, after step {steady_from})", "img/s (all steps)", "TFLOP/s (steady)",
               "of measured fp32 matmul", "of bf16 peak", "Data wait", "kNN acc", "Peak mem",
               "Load 1 min before / after"]
    body = []
    for r in rows:
        method, seed = r.get("method", "simclr"), r.get("seed", "-")
        if r.get("error"):
            body.append([method, seed, r["side"], "-", f"not measured: {r['error']}"] + ["-"] * (len(headers) - 5))
            continue
        steady = r.get("steady_images_per_s")
        warmup = "n/a" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f} s ({100 * r['warmup_share']:.0f} %)"
        tflops = r.get("steady_tflops_per_s") or r.get("tflops_per_s")
        body.append([method, seed, r["side"], r["version"], r["pipeline"], r["threads"], r["loader_workers"],
                     f"{r['steps']} x {r['global_batch']}", fmt_duration(r["train_time_s"]), warmup,
                     "n/a" if steady is None else f"{steady:.1f}", f"{r['images_per_s']:.1f}",
                     "n/a" if tflops is None else f"{tflops:.3f}",
                     "n/a" if r.get("matmul_fraction") is None else f"{100 * r['matmul_fraction']:.0f} %",
                     "n/a (peak unknown)" if r.get("peak_fraction") is None else f"{100 * r['peak_fraction']:.1f} %",
                     "n/a" if r.get("data_wait_share") is None else f"{100 * r['data_wait_share']:.0f} %",
                     f"{r['knn_top1']:.3f}", f"{r['peak_memory_mib']:.0f} MiB", load_pair(r)])
    text = markdown_table(headers, body)
    for method in dict.fromkeys(r.get("method", "simclr") for r in rows):
        text += _ratio_note(method, [r for r in rows if r.get("method", "simclr") == method], steady_from)
    text += knn_by_epoch_markdown(rows)
    flop_row = next((r for r in rows if r.get("step_gflop")), None)
    if flop_row is not None:
        peak, matmul = flop_row.get("bf16_peak_tflops"), flop_row.get("matmul_tflops_per_s")
        text += ("\nTFLOP/s: unison's count of the method's matrix work per step (forward + backward, "
                 "`torch.utils.flop_counter` via `unison.bench.flops`; SimCLR's serves both sides, the other methods' "
                 "Lightly heads differ) x steady images/s / batch"
                 + (f"; of measured fp32 matmul: against {matmul * 1e3:.0f} GFLOP/s, the best `torch.mm` (1024, 2048) "
                    "with the sides' threads, measured in this run" if matmul else "")
                 + (f"; of bf16 peak: against {peak:g} TFLOPS dense bf16.\n" if peak else
                    "; no bf16 peak is known for this device (CPU, or a GPU not in `BF16_PEAK_TFLOPS`; "
                    "pass --peak-tflops).\n"))
    return text


def verdict(difference: float, noise: float) -> str:
    """unison - Lightly judged against the noise, the larger spread of the seeds on one side."""
    return "above" if difference > noise else "within noise" if abs(difference) <= noise else "BELOW"


def _ratio_note(method: str, rows: list[dict[str, Any]], steady_from: int | None) -> str:
    """kNN difference and throughput ratio unison / Lightly of one method (both sides measured; means over the
    seeds, whose spread on each side is the noise), and a warning when a side's warm-up makes the all-steps rate
    mislead."""
    sides = {side: [r for r in rows if r["side"] == side and not r.get("error")] for side in ("unison", "lightly")}
    if not sides["unison"] or not sides["lightly"]:
        return ""

    def mean(side: str, key: str) -> float | None:
        values = [r[key] for r in sides[side] if r.get(key) is not None]
        return sum(values) / len(values) if len(values) == len(sides[side]) else None

    u_knn, l_knn = mean("unison", "knn_top1"), mean("lightly", "knn_top1")
    assert u_knn is not None and l_knn is not None
    text = f"\n**{method}: kNN unison - Lightly {u_knn - l_knn:+.3f}"
    spreads = [max(r["knn_top1"] for r in v) - min(r["knn_top1"] for r in v) for v in sides.values()]
    if min(len(v) for v in sides.values()) > 1:
        text += f" ({verdict(u_knn - l_knn, max(spreads))}: seed spread unison {spreads[0]:.3f}, Lightly {spreads[1]:.3f})"
    u_steady, l_steady = mean("unison", "steady_images_per_s"), mean("lightly", "steady_images_per_s")
    text += "; throughput unison / Lightly "
    if u_steady and l_steady:
        text += f"{u_steady / l_steady:.2f}x at steady state** (after step {steady_from}), "
    else:
        text += "** "
    u_all, l_all = mean("unison", "images_per_s"), mean("lightly", "images_per_s")
    assert u_all is not None and l_all is not None
    text += (f"{u_all / l_all:.2f}x over all steps (images/s of the training loop; all steps include each side's "
             "warm-up and, for Lightly, starting its loader workers at every epoch).\n")
    long_warmup = [s for s, v in sides.items() if any((r.get("warmup_share") or 0) > WARMUP_SHARE for r in v)]
    if long_warmup:
        text += (f"\nThe warm-up is over {WARMUP_SHARE:.0%} of the time of {' and '.join(long_warmup)}: quote the "
                 "steady rate, or raise --lightly-steps.\n")
    return text


def write_lightly(rows: list[dict[str, Any]], out_dir: Path, header: str = "") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = result_paths(out_dir, "lightly")
    paths["md"].write_text(header + lightly_markdown(rows))
    write_csv(paths["csv"], rows)
    return paths


def knn_by_epoch_markdown(rows: list[dict[str, Any]]) -> str:
    """The ``--lightly-epochs`` table: per method, batch and evaluated epoch, each side's kNN of every seed, the
    difference of the means and its verdict against the larger seed spread of one side at that epoch ("" when no
    row has kNN by epoch)."""
    measured = [r for r in rows if r.get("knn_by_epoch") and not r.get("error")]
    if not measured:
        return ""
    body = []
    for method, batch in dict.fromkeys((r["method"], r["global_batch"]) for r in measured):
        group = [r for r in measured if (r["method"], r["global_batch"]) == (method, batch)]
        points = {side: {(r.get("seed"), round(e, 6)): acc for r in group if r["side"] == side
                         for e, acc in r["knn_by_epoch"]} for side in ("unison", "lightly")}
        epochs = sorted({e for side in points.values() for _, e in side})
        for epoch in epochs:
            at = {side: [acc for (_, e), acc in v.items() if e == epoch] for side, v in points.items()}
            cells = [", ".join(f"{acc:.3f}" for acc in at[side]) or "-" for side in ("unison", "lightly")]
            judged, diff = "-", "-"
            if at["unison"] and at["lightly"]:
                delta = sum(at["unison"]) / len(at["unison"]) - sum(at["lightly"]) / len(at["lightly"])
                diff = f"{delta:+.3f}"
                if min(len(v) for v in at.values()) > 1:
                    noise = max(max(v) - min(v) for v in at.values())
                    judged = f"{verdict(delta, noise)} ({noise:.3f})"
            body.append([method, batch, f"{epoch:g}", *cells, diff, judged])
    return ("\n### kNN by epoch\n\nEach side's kNN (one value per seed) at each evaluated epoch; the verdict "
            "against the larger seed spread of one side at that epoch.\n\n"
            + markdown_table(["Method", "Batch", "Epoch", "unison kNN", "Lightly kNN", "unison - Lightly",
                              "verdict (noise)"], body))
