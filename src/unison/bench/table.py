"""The distributed table (Lightly's layout) and the CPU scaling measurement, through `unison train`.

Every configuration is one real training run of `unison.train`, described by the
``unison train`` arguments a user would type (printed with each row, so any row can be
reproduced) and run in fresh worker processes even for one worker (``isolated=True``),
which keeps each worker's peak memory its own (`Summary.peak_memory_mib` per rank: peak
resident set on CPU, CUDA allocator peak on GPU).

Rows per method: 1 worker; W workers with SyncBN + gather (exact: the same training as the
1-worker row); W workers with gather only (per-rank batch-norm statistics, as many
frameworks run by default). Time = the training loop (``train_time_s``: steps, all-reduces,
epoch checkpoints; not process start-up, data loading or the two kNN evaluations, which
the "wall" column includes). Speed-up = time of the 1-worker row / time of the row.

Scaling: 1 worker x 1 thread vs W workers x 1 thread on the same global batch for a fixed
number of steps; images/s = steps x global batch / training time.
"""

from __future__ import annotations

import math
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.config.fields import count
from unison.errors import BenchError

from .config import BenchConfig, format_load, loadavg, wait_for_load
from .report import fmt_duration, markdown_table, plot_table, result_paths, write_csv


@dataclass
class RunSpec:
    method: str
    config: str            # row label
    workers: int
    sync_batchnorm: bool = True
    gather: bool = True
    threads: int | None = None
    max_steps: int | None = None
    tag: str = ""          # run-directory prefix, e.g. "scaling-"

    @property
    def name(self) -> str:
        if self.workers == 1:
            return f"{self.tag}{self.method}-w1"
        return f"{self.tag}{self.method}-w{self.workers}" + ("-syncbn" if self.sync_batchnorm else "") + (
            "-gather" if self.gather else "")


def table_specs(cfg: BenchConfig) -> list[RunSpec]:
    w = cfg.workers
    specs = []
    for m in cfg.method_list:
        specs += [RunSpec(m, "1 worker", 1, threads=cfg.threads),
                  RunSpec(m, f"{w} workers, SyncBN + gather", w, True, True, threads=cfg.threads),
                  RunSpec(m, f"{w} workers, gather only", w, False, True, threads=cfg.threads)]
    return specs


def scaling_specs(cfg: BenchConfig) -> list[RunSpec]:
    threads = 1 if cfg.preset == "cpu" else cfg.threads
    m = "simclr" if "simclr" in cfg.method_list else cfg.method_list[0]
    return [RunSpec(m, f"1 worker x {threads or 'auto'} thread", 1, threads=threads, max_steps=cfg.scaling_steps,
                    tag="scaling-"),
            RunSpec(m, f"{cfg.workers} workers x {threads or 'auto'} thread", cfg.workers, threads=threads,
                    max_steps=cfg.scaling_steps, tag="scaling-")]


def train_argv(cfg: BenchConfig, spec: RunSpec, data: str, val: str | None, run_dir: Path) -> list[str]:
    """`unison train` arguments of one configuration."""
    from unison.distributed.launch import find_free_port

    epochs = 1000 if spec.max_steps else cfg.epochs   # step-bounded runs stop at max_steps
    argv = ["train", "--method", spec.method, "--backbone", cfg.backbone, "--data", data,
            "--epochs", str(epochs), "--batch-size", str(cfg.batch_size), "--knn-k", str(cfg.knn_k),
            "--seed", str(cfg.seed), "--world-size", str(spec.workers), "--out", str(run_dir), "--no-progress"]
    if val:
        argv += ["--val", val]
    if cfg.subset:
        argv += ["--subset", str(cfg.subset)]
    if cfg.val_subset:
        argv += ["--val-subset", str(cfg.val_subset)]
    if spec.threads:
        argv += ["--threads", str(spec.threads)]
    if spec.max_steps:
        argv += ["--max-steps", str(spec.max_steps)]
    if spec.workers > 1:
        argv += ["--backend", cfg.backend, "--sync-batchnorm" if spec.sync_batchnorm else "--no-sync-batchnorm",
                 "--gather" if spec.gather else "--no-gather"]
    elif cfg.backend == "nccl":
        # One worker on a GPU: 'auto' would choose the in-memory single-process group, which runs on the CPU.
        argv += ["--backend", "nccl", "--master-port", str(find_free_port())]
    return argv + cfg.train_words


def run_train(argv: list[str], run_dir: Path) -> tuple[dict[str, Any], float]:
    """Train what ``unison train ARGV`` describes, in fresh worker processes; return (summary, wall seconds)."""
    from unison.api import train
    from unison.cli.train_args import parse_train_args
    from unison.errors import Preempted, UnisonError

    if run_dir.exists():
        shutil.rmtree(run_dir)   # a fresh run, never a resumed or mixed one
    cfg = parse_train_args(argv[1:])   # argv[0] is the subcommand, "train"
    started = time.perf_counter()
    try:
        summary = train(cfg, isolated=True)
    except Preempted:
        raise   # the bench was asked to stop (`unison.bench.commands`), not a failed run
    except UnisonError as exc:
        raise BenchError(f"'unison {shlex.join(argv[:3])} ...' failed: {exc}") from None
    return summary.to_dict(), time.perf_counter() - started


def measure(cfg: BenchConfig, specs: list[RunSpec], data: str, val: str | None, out_dir: Path,
            verbose: bool = True) -> list[dict[str, Any]]:
    """Run every spec (waiting for a quiet machine first when --max-load is set); one row per run."""
    rows = []
    for spec in specs:
        run_dir = out_dir / "runs" / spec.name
        argv = train_argv(cfg, spec, data, val, run_dir)
        load = wait_for_load(cfg.max_load, cfg.load_wait_s)
        if verbose:
            print(f"unison bench: {spec.method} / {spec.config} (load {format_load(load)}) ...", flush=True)
        summary, wall = run_train(argv, run_dir)
        rows.append(row_from_summary(spec, summary, wall, load, argv))
        after = loadavg()   # includes this run's own workers
        rows[-1]["load_1m_after"] = after[0] if after else None
        if verbose:
            r = rows[-1]
            print(f"  kNN {r['knn_top1']:.4f}, training {fmt_duration(r['train_time_s'])} "
                  f"({r['images_per_s']:.0f} img/s), peak {r['peak_memory_mib']:.0f} MiB/worker", flush=True)
    return rows


def row_from_summary(spec: RunSpec, s: dict[str, Any], wall: float, load, argv: list[str]) -> dict[str, Any]:
    peaks = s.get("peak_memory_mib") or []
    return {
        "method": spec.method, "config": spec.config, "backbone": s["backbone"], "global_batch": s["global_batch"],
        "epochs": s["epochs"], "steps": s["steps"], "workers": s["world_size"],
        "sync_batchnorm": spec.sync_batchnorm if spec.workers > 1 else None,
        "gather": spec.gather if spec.workers > 1 else None, "threads_per_worker": spec.threads,
        "knn_top1": s["knn_top1"], "random_init_knn_top1": s["random_init_knn_top1"], "final_loss": s["final_loss"],
        "train_time_s": s["train_time_s"], "wall_s": wall,
        "images_per_s": s["steps"] * s["global_batch"] / max(s["train_time_s"], 1e-9),
        "speedup": None, "peak_memory_mib": max(peaks) if peaks else math.nan, "peak_memory_per_rank": peaks,
        "peak_memory_kind": s.get("peak_memory_kind"),
        "load_1m": load[0] if load else None, "load_5m": load[1] if load else None,
        "load_15m": load[2] if load else None,
        "command": "unison " + shlex.join(argv),
    }


def baseline_memory_mib() -> float | None:
    """Peak resident set of a process that only imports unison's training loop (torch, torchvision, ...)."""
    import subprocess
    import sys

    code = ("import unison.training.trainer, torch; from unison.training.summary import peak_memory_mib; "
            "print(peak_memory_mib(torch.device('cpu')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return float(proc.stdout.split()[-1])
    except (IndexError, ValueError):
        return None


def add_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """speedup = training time of the method's 1-worker row / this row's."""
    for r in rows:
        base = next((b for b in rows if b["method"] == r["method"] and b["workers"] == 1), None)
        r["speedup"] = base["train_time_s"] / r["train_time_s"] if base and r["train_time_s"] else None
    return rows


# --------------------------------------------------------------------------- writers
def _yes_no(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def load_pair(r: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    return f(r.get("load_1m")) + (f" / {f(r['load_1m_after'])}" if "load_1m_after" in r else "")


def budget_note(rows: list[dict[str, Any]]) -> str:
    """The table's budget in one line: what each run trains and what all of them took (the figures of these rows)."""
    if not rows:
        return ""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    shapes = sorted({(r["steps"], r["global_batch"], r["epochs"]) for r in rows})
    per_run = "; ".join(f"{_count(steps, 'step')} of {batch} images ({_count(epochs, 'epoch')})"
                        for steps, batch, epochs in shapes)
    train = sum(r["train_time_s"] for r in rows)
    wall = sum(r.get("wall_s") or 0.0 for r in rows)
    return (f"**Budget:** {_count(len(rows), 'run')} ({_count(len(methods), 'method')} x "
            f"{_count(len(rows) // max(1, len(methods)), 'configuration')}), each {per_run}; training "
            f"{fmt_duration(train)} in all, {fmt_duration(wall)} of wall-clock with start-up and kNN.\n\n")


def _count(n: float, noun: str) -> str:
    """`unison.config.fields.count`, for fractional epochs too (``1.5 epochs``)."""
    return count(int(n), noun) if float(n).is_integer() else f"{n:g} {noun}s"


def table_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["Method", "Backbone", "Batch", "Epochs", "Workers", "SyncBN", "Gather", "kNN acc (random init)",
               "Time", "Speed-up", "img/s", "Peak mem / worker", "Wall", "Load 1 min before / after"]
    body = []
    for r in rows:
        rnd = r.get("random_init_knn_top1")
        body.append([
            r["method"], r["backbone"], r["global_batch"], f"{r['epochs']:g}", r["workers"], _yes_no(r["sync_batchnorm"]),
            _yes_no(r["gather"]), f"{r['knn_top1']:.3f}" + (f" ({rnd:.3f})" if rnd is not None else ""),
            fmt_duration(r["train_time_s"]), "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            f"{r['images_per_s']:.0f}", f"{r['peak_memory_mib']:.0f} MiB", fmt_duration(r.get("wall_s")),
            load_pair(r),
        ])
    return markdown_table(headers, body)


def write_table(rows: list[dict[str, Any]], out_dir: Path, header: str = "", title: str = "unison bench",
                baseline_mib: float | None = None) -> dict[str, Path]:
    """table.md (header + table), table.csv and table.png in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = result_paths(out_dir, "table")
    kind = next((r.get("peak_memory_kind") for r in rows if r.get("peak_memory_kind")), None)
    mem_note: dict[str | None, str] = {
        "peak_rss": "peak resident set size (VmHWM) of each worker process, the largest over workers",
        "cuda_max_allocated": "torch.cuda.max_memory_allocated of each worker, the largest over workers"}
    notes = ("\nTime: the training loop (`train_time_s`); Wall: the whole `unison train` process (start-up, data "
             "loading, kNN before and after). Speed-up: time of the 1-worker row / time of the row. Load after a run "
             "includes the run's own workers. "
             f"Peak mem / worker: {mem_note.get(kind, 'as reported by the workers')}"
             + (f"; a process that only imports the training loop peaks at {baseline_mib:.0f} MiB"
                if baseline_mib and kind == "peak_rss" else "") + ".\n")
    paths["md"].write_text(header + budget_note(rows) + table_markdown(rows) + notes)
    write_csv(paths["csv"], rows)
    plot_table(rows, paths["png"], title)
    return paths


def scaling_markdown(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    headers = ["Method", "Workers x threads", "Global batch", "Steps", "Training time", "img/s", "Ratio vs 1 worker",
               "Efficiency", "Load 1 min before / after"]
    body = []
    for r in rows:
        ratio = r["images_per_s"] / base["images_per_s"]
        body.append([r["method"], f"{r['workers']} x {r['threads_per_worker'] or 'auto'}", r["global_batch"], r["steps"],
                     fmt_duration(r["train_time_s"]), f"{r['images_per_s']:.1f}", f"{ratio:.2f}x",
                     f"{ratio / r['workers']:.0%}", load_pair(r)])
    return markdown_table(headers, body)


def write_scaling(rows: list[dict[str, Any]], out_dir: Path, header: str = "") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = result_paths(out_dir, "scaling")
    for r in rows:
        r["ratio_vs_1_worker"] = r["images_per_s"] / rows[0]["images_per_s"]
    paths["md"].write_text(header + scaling_markdown(rows))
    write_csv(paths["csv"], rows)
    return paths
