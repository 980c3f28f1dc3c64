"""`unison bench race`: unison and Lightly SSL's documented SimCLR pipeline, the same wall-clock budget each.

Both sides train SimCLR with the same backbone type on the same images (the CIFAR-10 training folder, all
45,000 images unless ``--race-subset``), one after the other in fresh processes, the load recorded before each.
Each side's clock starts with its setup (data loading included) and the budget covers everything up to its last
encoder:

* unison: ``unison train --preset speedrun --time-budget B`` (`unison.training.budget`: it measures its step,
  plans the warm-up and cosine for the steps that fit, stops on time), the bench's backbone and batch;
* Lightly: its documented pipeline (the PIL dataset, ``SimCLRTransform`` with Lightly's CIFAR-10 settings, a
  ``DataLoader`` with worker processes, ``SimCLRProjectionHead``, ``NTXentLoss``) with the hyper-parameters of
  Lightly's CIFAR-10 benchmark (SGD, learning rate 0.06 per 128 images, momentum 0.9, weight decay 5e-4,
  temperature 0.5, cosine). Lightly has no time budget, so its side gets what a user would do by hand: after
  `LIGHTLY_WARMUP` + `LIGHTLY_TIMED` steps its measured step time decides the steps that fit, and the cosine is
  planned over them (the first steps run at the peak rate, where a cosine starts anyway); it stops on time.

Every ``budget / --race-points`` seconds, and after its last step, each side saves its encoder
(`benchmarks.lab.race_hook.save_snapshot`). After both have finished, every snapshot is scored by the same code,
`unison.eval.knn.knn_accuracy` on the val images (k = ``--knn-k``, t = 0.1, unison's evaluation transform), so
the evaluation costs neither side any of its budget. The report: both final accuracies, the time unison took to
pass Lightly's final accuracy (its first evaluation point at or above it), the kNN-versus-wall-time curve of both
(``race.png``), and ``race.csv`` with every point.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from unison.bench.config import format_load, loadavg, wait_for_load
from unison.bench.report import fmt_duration, markdown_table, write_csv
from unison.config.budget import parse_duration
from unison.errors import BenchError

from . import race_hook
from .config import LabConfig
from .lightly_compare import PILImages, package_version, run_side_process, side_threads, user_loader_context
from .parts import result_paths
from .race_hook import ENV as SNAPSHOT_ENV
from .race_hook import save_snapshot

LIGHTLY_WARMUP, LIGHTLY_TIMED = 3, 10   # Lightly's side: untimed steps (loader start), then timed ones
LIGHTLY_LR_PER_128 = 0.06               # Lightly's CIFAR-10 benchmark: lr = 6e-2 * batch_size / 128


def unison_argv(cfg: LabConfig, data: str, run_dir: Path, threads: int) -> list[str]:
    """The `unison train` arguments of unison's side (no --val: the race scores the snapshots afterwards)."""
    argv = ["train", "--preset", "speedrun", "--backbone", cfg.backbone, "--data", data, "--batch-size",
            str(cfg.batch_size), "--time-budget", cfg.budget, "--seed", str(cfg.seed), "--world-size", "1",
            "--threads", str(threads), "--out", str(run_dir), "--no-progress"]
    if cfg.race_subset:
        argv += ["--subset", str(cfg.race_subset)]
    if cfg.backend == "nccl":   # one GPU worker: 'auto' would pick the in-memory single-process group (CPU)
        from unison.distributed.launch import find_free_port

        argv += ["--backend", "nccl", "--master-port", str(find_free_port())]
    return argv + cfg.train_words


def _unison_side(cfg: LabConfig, data: str, out_dir: Path, snapshots: Path, threads: int) -> dict[str, Any]:
    from unison.bench.table import run_train

    argv = unison_argv(cfg, data, out_dir / "runs" / "race-unison", threads)
    every_s = parse_duration(cfg.budget) / cfg.race_points
    os.environ["UNISON_TRAIN_HOOKS"] = race_hook.__name__   # the workers import it (from the repository root)
    os.environ[SNAPSHOT_ENV] = json.dumps({"dir": str(snapshots), "every_s": every_s})
    try:
        summary, wall = run_train(argv, out_dir / "runs" / "race-unison")
    finally:
        os.environ.pop("UNISON_TRAIN_HOOKS", None)
        os.environ.pop(SNAPSHOT_ENV, None)
    budget = summary["extra"].get("time_budget") or {}
    return {"side": "unison", "version": package_version("unison"), "command": "unison " + shlex.join(argv),
            "steps": summary["steps"], "global_batch": summary["global_batch"], "used_s": budget.get("used_s"),
            "wall_s": wall, "pipeline": "uint8 data on the device + batched augmentation + --time-budget plan"}


def _lightly_model(backbone_name: str, image_size: int) -> Any:
    import torch.nn as nn
    from lightly.models.modules import SimCLRProjectionHead

    from unison.models import build_backbone

    class LightlySimCLR(nn.Module):   # as in Lightly's SimCLR example
        def __init__(self) -> None:
            super().__init__()
            self.backbone, dim = build_backbone(backbone_name, image_size)
            self.projection_head = SimCLRProjectionHead(dim, 512, 128)

        def forward(self, x: Any) -> Any:
            return self.projection_head(self.backbone(x).flatten(start_dim=1))

    return LightlySimCLR()


def _lightly_child(p: dict[str, Any], result_path: str) -> None:
    """Lightly's side, in its own process: train until the budget is spent, saving snapshots on the way."""
    started = time.perf_counter()
    import torch
    from lightly.loss import NTXentLoss
    from lightly.transforms import SimCLRTransform
    from torch.utils.data import DataLoader

    from unison.data import load_dataset
    from unison.models.backbones import resolve_backbone

    torch.set_num_threads(p["threads"])
    torch.manual_seed(p["seed"])
    device = torch.device(p["device"])
    train = load_dataset(p["data"], "train", subset=p["subset"], seed=p["seed"])
    transform = SimCLRTransform(input_size=train.image_size, cj_strength=0.5, gaussian_blur=0.0,
                                normalize={"mean": list(train.mean), "std": list(train.std)})
    loader: DataLoader[Any] = DataLoader(PILImages(train.images, train.labels, transform),  # type: ignore[arg-type]
                                         batch_size=p["batch_size"], shuffle=True, drop_last=True,
                                         num_workers=p["loader_workers"], pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(p["seed"]),
                                         **user_loader_context(p["loader_workers"]))
    arch = resolve_backbone(p["backbone"], train.image_size)
    model, criterion = _lightly_model(arch, train.image_size).to(device), NTXentLoss(temperature=0.5)
    peak = LIGHTLY_LR_PER_128 * p["batch_size"] / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9, weight_decay=5e-4)
    budget_s, every_s, snapshots = p["budget_s"], p["budget_s"] / p["points"], Path(p["snapshots"])
    step, total, step_s, timed_from, next_s, index = 0, None, 0.0, 0.0, every_s, 0
    model.train()
    while True:
        for (x0, x1), _ in loader:
            if time.perf_counter() - started >= budget_s:   # e.g. after an epoch's start of the loader workers
                return _lightly_end(snapshots, index, model.backbone, arch, step, started, total, result_path)
            lr = peak if total is None else peak * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            x0, x1 = x0.to(device, non_blocking=True), x1.to(device, non_blocking=True)
            loss = criterion(model(x0), model(x1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter() - started
            if step == LIGHTLY_WARMUP:
                timed_from = now
            elif step == LIGHTLY_WARMUP + LIGHTLY_TIMED:
                step_s = (now - timed_from) / LIGHTLY_TIMED
                total = step + max(0, int((budget_s * 0.98 - now - step_s) / step_s))
            if now + step_s >= budget_s or (total is not None and step >= total):
                return _lightly_end(snapshots, index, model.backbone, arch, step, started, total, result_path)
            if now >= next_s:
                save_snapshot(snapshots, "lightly", index, model.backbone, arch, step, now)
                index, next_s = index + 1, next_s + every_s * math.ceil((now - next_s + 1e-9) / every_s)


def _lightly_end(snapshots: Path, index: int, backbone: Any, arch: str, step: int, started: float,
                 planned: int | None, result_path: str) -> None:
    """Lightly's last encoder and what its side did."""
    save_snapshot(snapshots, "lightly", index, backbone, arch, step, time.perf_counter() - started)
    Path(result_path).write_text(json.dumps({"steps": step, "used_s": time.perf_counter() - started,
                                             "planned_steps": planned}))


def _lightly_side(cfg: LabConfig, data: str, out_dir: Path, snapshots: Path, threads: int) -> dict[str, Any]:
    payload = {"data": data, "subset": cfg.race_subset, "seed": cfg.seed, "batch_size": cfg.batch_size,
               "backbone": cfg.backbone, "loader_workers": cfg.lightly_loader_workers, "threads": threads,
               "budget_s": parse_duration(cfg.budget), "points": cfg.race_points, "snapshots": str(snapshots),
               "device": "cuda" if cfg.backend == "nccl" else "cpu"}
    r, wall = run_side_process(_lightly_child, payload, out_dir / "race_lightly.json", "lightly-race",
                               "the Lightly side")
    return {"side": "lightly", "version": package_version("lightly"), "command": f"Lightly SimCLR, {json.dumps(payload)}",
            "steps": r["steps"], "global_batch": cfg.batch_size, "used_s": r["used_s"], "wall_s": wall,
            "pipeline": "PIL dataset + SimCLRTransform + DataLoader workers + SimCLRProjectionHead + NTXentLoss"}


def score_snapshots(cfg: LabConfig, data: str, val: str | None, snapshots: Path) -> list[dict[str, Any]]:
    """Every snapshot's kNN top-1 on the val images, by the same code for both sides; one row per snapshot."""
    import torch

    from unison.data import eval_transform, load_dataset
    from unison.eval.knn import knn_accuracy
    from unison.models import build_backbone

    torch.set_num_threads(side_threads(cfg))
    train = load_dataset(data, "train", subset=cfg.race_subset, seed=cfg.seed)
    held = load_dataset(val or data, "val", subset=cfg.race_val_subset, seed=cfg.seed)
    rows = []
    for path in sorted(snapshots.glob("*.pt")):
        snap = torch.load(path, map_location="cpu", weights_only=True)
        backbone, _ = build_backbone(snap["backbone"], train.image_size)
        backbone.load_state_dict(snap["state"])
        backbone.eval()
        acc = knn_accuracy(backbone, train.images, train.labels, held.images, held.labels,
                           lambda x: eval_transform(x, train.image_size, train.mean, train.std),
                           len(train.classes), k=cfg.knn_k, t=0.1)
        rows.append({"side": path.stem.split("-")[0], "time_s": round(float(snap["time_s"]), 3),
                     "step": int(snap["step"]), "knn_top1": acc})
    return rows


def race(cfg: LabConfig, data: str, val: str | None, out_dir: Path) -> dict[str, Any]:
    """Train unison's side, then Lightly's, then score every snapshot; the race's result."""
    from .lightly_compare import lightly_available

    why_not = lightly_available()
    if why_not is not None:
        raise BenchError(f"the race needs Lightly SSL ({why_not})")
    snapshots = out_dir / "race_snapshots"
    shutil.rmtree(snapshots, ignore_errors=True)
    snapshots.mkdir(parents=True)
    threads, sides = side_threads(cfg), []
    for name, side in (("unison", _unison_side), ("lightly", _lightly_side)):
        load = wait_for_load(cfg.max_load, cfg.load_wait_s)
        print(f"unison bench: race, {name} side, budget {cfg.budget} (load {format_load(load)}) ...", flush=True)
        row = side(cfg, data, out_dir, snapshots, threads)
        sides.append({**row, "budget_s": parse_duration(cfg.budget), "threads": threads,
                      "load_1m": load[0] if load else None, "load_1m_after": (loadavg() or [None])[0]})
    print(f"unison bench: race, scoring {len(list(snapshots.glob('*.pt')))} snapshots (load "
          f"{format_load(loadavg())}) ...", flush=True)
    points = score_snapshots(cfg, data, val, snapshots)
    return summarise(sides, points, held_out_name(data, val))


def held_out_name(data: str, val: str | None) -> str:
    """The images the race scores on, as the user gave them: ``--val``'s path, or those held back from ``--data``."""
    return str(val) if val else f"images held back from {data}"


def summarise(sides: list[dict[str, Any]], points: list[dict[str, Any]], held_out: str) -> dict[str, Any]:
    """Final accuracies (each side's last point), the time unison took to reach Lightly's final one, and the
    held-out set they were scored on."""
    curve = {s["side"]: sorted((p for p in points if p["side"] == s["side"]), key=lambda p: p["time_s"])
             for s in sides}
    for s in sides:
        s["knn_top1"] = curve[s["side"]][-1]["knn_top1"] if curve[s["side"]] else None
    final = {s["side"]: s["knn_top1"] for s in sides}
    passed = None
    if final.get("lightly") is not None:
        passed = next((p["time_s"] for p in curve.get("unison", []) if p["knn_top1"] >= final["lightly"]), None)
    return {"sides": sides, "points": points, "unison_passes_lightly_s": passed, "held_out": held_out}


def race_markdown(result: dict[str, Any]) -> str:
    sides, passed = result["sides"], result["unison_passes_lightly_s"]
    headers = ["Side", "Version", "Pipeline", "Budget", "Used", "Steps x batch", "kNN top-1 (final)",
               "Load 1 min before / after"]
    body = [[s["side"], s["version"], s["pipeline"], fmt_duration(s["budget_s"]), fmt_duration(s["used_s"]),
             f"{s['steps']} x {s['global_batch']}", "n/a" if s["knn_top1"] is None else f"{s['knn_top1']:.4f}",
             f"{s['load_1m'] if s['load_1m'] is not None else 'n/a'} / {s['load_1m_after'] or 'n/a'}"]
            for s in sides]
    text = f"kNN top-1 on {result['held_out']}.\n\n" + markdown_table(headers, body)
    budget = sides[0]["budget_s"]
    text += ("\n**unison passed Lightly's final kNN after " + (
        f"{fmt_duration(passed)} ({passed / budget:.0%} of the budget)**" if passed is not None else
        "- (not within its evaluation points)**") + ": its first evaluation point at or above it.\n")
    text += (f"\nEvaluation points (kNN of each snapshot on {result['held_out']}, scored "
             "after both sides finished):\n\n")
    text += markdown_table(["Side", "Wall time", "Step", "kNN top-1"],
                           [[p["side"], fmt_duration(p["time_s"]), p["step"], f"{p['knn_top1']:.4f}"]
                            for p in sorted(result["points"], key=lambda p: (p["side"], p["time_s"]))])
    commands = "\n".join(f"* {s['side']}: `{s['command']}`" for s in sides)
    return text + f"\n{commands}\n\n![kNN versus wall time](race.png)\n"


def plot_race(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for side in ("unison", "lightly"):
        pts = sorted((p for p in result["points"] if p["side"] == side), key=lambda p: p["time_s"])
        ax.plot([p["time_s"] / 60 for p in pts], [p["knn_top1"] for p in pts], marker="o", label=side)
    if result["unison_passes_lightly_s"] is not None:
        ax.axvline(result["unison_passes_lightly_s"] / 60, color="grey", ls=":", label="unison passes Lightly's final")
    ax.set_xlabel("wall-clock time (min)")
    held_out = result["held_out"]
    ax.set_ylabel(f"kNN top-1 on {held_out if len(held_out) <= 40 else '...' + held_out[-37:]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_race(result: dict[str, Any], out_dir: Path, header: str = "") -> dict[str, Path]:
    paths = result_paths(out_dir, "race")
    paths["md"].write_text(header + race_markdown(result))
    write_csv(paths["csv"], result["points"])
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    plot_race(result, paths["png"])
    return paths
