"""Each method side by side with Lightly SSL: the same backbone, data, global batch and steps, each its own recipe.

``unison bench lightly --method M`` (a name, names, ``seed`` for the six of Lightly's table, ``all`` for every
method with a Lightly side: `benchmarks.lab.lightly_methods`).

Lightly's side is its documented pipeline: a map-style dataset that turns each stored
image into a PIL image (what ``torchvision.datasets.CIFAR10.__getitem__`` does) and applies
the method's Lightly transform per sample, a ``torch.utils.data.DataLoader`` (shuffle,
drop_last, worker processes), the backbone with Lightly's heads, loss, momentum updates and
optimizer for the method (`benchmarks.lab.lightly_methods`: Lightly's CIFAR-10 settings).

unison's side is ``unison train --method M --world-size 1`` at the method's recipe (uint8
tensor dataset, batched augmentation on the device) with the same backbone type
(`unison.models.build_backbone`), images (same subset and seed), global batch and steps;
both sides follow unison's cosine schedule without warm-up, a pure function of the step.

Both sides run as one training process each (Lightly's has its DataLoader workers
besides), one after the other, in fresh processes under the benchmark's process. Throughput
= steps x batch / the training loop's time (Lightly's includes starting its loader workers
each epoch, as an epoch does). Both encoders are scored by the same code,
`unison.eval.knn.knn_accuracy` with unison's evaluation transform; peak memory is each training
process's (peak resident set on the CPU, the CUDA allocator's peak on a GPU).

``--lightly-epochs N`` compares by epochs instead of steps: unison's side trains ``--epochs N`` (its recipe's
steps per epoch, the data's size // the batch), Lightly's the same number of steps; with ``--lightly-eval-every E``
both sides score kNN every E epochs (unison's ``--eval-every E``; Lightly's loop pauses its clock for it), and the
report adds a table of kNN by epoch, each point judged against the seeds' spread at that point.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from unison.bench.config import format_load, loadavg, wait_for_load
from unison.bench.table import RunSpec, run_train, train_argv
from unison.config import TrainConfig
from unison.config.extras import install_command
from unison.errors import BenchError

from .config import LabConfig
from .lightly_report import WARMUP_SHARE, lightly_markdown, write_lightly

__all__ = ["WARMUP_SHARE", "compare", "lightly_available", "lightly_markdown", "write_lightly"]


def lightly_available() -> str | None:
    """None if Lightly SSL imports, else why not (one line)."""
    try:
        import lightly  # noqa: F401
        from lightly.loss import NTXentLoss  # noqa: F401
        from lightly.models.modules import SimCLRProjectionHead  # noqa: F401
        from lightly.transforms import SimCLRTransform  # noqa: F401
    except Exception as exc:  # ImportError, or a broken dependency
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; {install_command('bench')}"
    return None


class PILImages:
    """Map-style dataset over uint8 [N, 3, H, W] images, PIL per sample, as torchvision's CIFAR10 serves them."""

    def __init__(self, images, labels, transform):
        self.data = images.permute(0, 2, 3, 1).contiguous().numpy()   # HWC uint8, like CIFAR10.data
        self.targets = labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def user_loader_context(workers: int) -> dict[str, Any]:
    """The DataLoader argument that gives the Lightly side's workers the start method a Lightly user's get on
    Linux: fork, Python's default there. The side runs in a spawned process, whose default is spawn: every worker
    would then re-import torch and unpickle the whole data set at every epoch, a cost a Lightly user does not pay
    and that can leave the side far slower than the pipeline it stands for."""
    if workers == 0 or "fork" not in mp.get_all_start_methods():
        return {}
    return {"multiprocessing_context": mp.get_context("fork")}


def _lightly_child(p: dict[str, Any], result_path: str) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from unison.data import eval_transform, load_dataset
    from unison.eval.knn import knn_accuracy
    from unison.models import build_backbone
    from unison.training.step import Schedule
    from unison.training.summary import peak_memory_mib

    from .lightly_methods import build_lightly_side

    torch.set_num_threads(p["threads"])
    torch.manual_seed(p["seed"])
    device = torch.device(p["device"])
    train = load_dataset(p["data"], "train", subset=p["subset"], seed=p["seed"])
    val = load_dataset(p["val"] or p["data"], "val", subset=p["val_subset"], seed=p["seed"])
    backbone, dim = build_backbone(p["backbone"], train.image_size)
    side = build_lightly_side(p["method"], backbone, dim, train.image_size,
                              {"mean": list(train.mean), "std": list(train.std)})
    # A map-style dataset (__getitem__ + __len__) is all DataLoader needs; its stubs ask for a Dataset subclass.
    images = cast("Dataset[Any]", PILImages(train.images, train.labels, side.transform))
    loader: DataLoader[Any] = DataLoader(images, batch_size=p["batch_size"], shuffle=True, drop_last=True,
                                         num_workers=p["loader_workers"], pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(p["seed"]),
                                         **user_loader_context(p["loader_workers"]))
    model = side.model.to(device)
    peak_lr = side.recipe.peak_lr(p["batch_size"])
    optimizer = side.recipe.optimizer_for(model, peak_lr)
    steps = p["steps"]
    schedule = Schedule(peak_lr, warmup_steps=0, total_steps=steps)   # unison's schedule, so both sides match
    to_eval = lambda x: eval_transform(x, train.image_size, train.mean, train.std)  # noqa: E731

    def knn() -> float:
        model.eval()
        with torch.no_grad():
            acc = knn_accuracy(model.backbone, train.images.to(device), train.labels.to(device),
                               val.images.to(device), val.labels.to(device), to_eval, len(train.classes),
                               k=p["knn_k"], t=0.1)
        model.train()
        return acc

    step_end, wait_s, final_loss, knn_by_step = _train_lightly(model, loader, optimizer, schedule, p, device, knn)
    train_time = step_end[-1]
    final_knn = knn()
    per_epoch = p.get("steps_per_epoch")
    Path(result_path).write_text(json.dumps({
        "steps": steps, "train_time_s": train_time, "step_end_s": step_end, "knn_top1": final_knn,
        "knn_by_epoch": [[step / per_epoch, acc] for step, acc in [*knn_by_step, (steps, final_knn)]]
        if per_epoch else None, "final_loss": final_loss,
        "data_wait_share": wait_s / train_time,
        "peak_memory_mib": peak_memory_mib(device), "train_images": len(train), "val_images": len(val),
        "recipe": f"{side.recipe.optimizer} peak lr {peak_lr:.4g}, weight decay {side.recipe.weight_decay:g}"}))


def _train_lightly(model, loader, optimizer, schedule, p: dict[str, Any], device,
                   knn: Callable[[], float]) -> tuple:
    """Lightly's training loop (the method's step: `LightlySide.model.training_loss`): (seconds since the start at
    the end of every step, seconds blocked on the loader for the next batch (its data wait), the final loss, and
    [step, kNN] at each of ``p["eval_steps"]``, scored by `knn` with the clock paused: an evaluation is not
    training time, as unison's side does not count its own)."""
    import torch

    step_end: list[float] = []
    knn_by_step: list[tuple[int, float]] = []
    eval_steps = set(p.get("eval_steps") or ())
    wait_s, step = 0.0, 0
    model.train()
    started = time.perf_counter()
    while step < p["steps"]:
        batches = iter(loader)
        while step < p["steps"]:
            asked = time.perf_counter()
            batch = next(batches, None)
            wait_s += time.perf_counter() - asked
            if batch is None:   # the epoch's end: a new epoch starts its loader workers again
                break
            views, _ = batch
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=p["amp"] == "bf16"):
                loss = model.training_loss([v.to(device, non_blocking=True) for v in views], step, p["steps"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_end.append(time.perf_counter() - started)
            if step in eval_steps:
                paused = time.perf_counter()
                knn_by_step.append((step, knn()))
                started += time.perf_counter() - paused
    return step_end, wait_s, float(loss.detach()), knn_by_step


def run_lightly_side(cfg: LabConfig, method: str, data: str, val: str | None, out_dir: Path, threads: int,
                     device: str, by_epoch: tuple[int, int] | None = None) -> tuple[dict[str, Any], float]:
    """Lightly's side in its own process: ``--lightly-steps`` steps, or with `by_epoch` (steps, steps per epoch),
    unison's side's steps and its kNN epochs."""
    steps = by_epoch[0] if by_epoch else cfg.lightly_steps
    per_epoch = by_epoch[1] if by_epoch else None
    every = cfg.lightly_eval_every * per_epoch if per_epoch else 0
    payload = {"method": method, "data": data, "val": val, "subset": cfg.subset, "val_subset": cfg.val_subset,
               "seed": cfg.seed, "steps_per_epoch": per_epoch,
               "eval_steps": list(range(every, steps, every)) if every else [],
               "batch_size": cfg.batch_size, "steps": steps, "backbone": cfg.backbone,
               "loader_workers": cfg.lightly_loader_workers, "threads": threads, "knn_k": cfg.knn_k, "device": device,
               "amp": train_flag(cfg.train_words, "--amp") or "none"}
    return run_side_process(_lightly_child, payload, out_dir / f"lightly_side_{method}_seed{cfg.seed}.json",
                            "lightly-side", f"the Lightly side of {method}")


def run_side_process(target: Callable[[dict[str, Any], str], None], payload: dict[str, Any], result: Path,
                     name: str, what: str) -> tuple[dict[str, Any], float]:
    """`target(payload, result)` in a fresh spawned process (its own torch and threads), as each Lightly side
    runs: (the JSON it wrote to `result`, wall seconds); `BenchError` naming `what` when it failed."""
    result.unlink(missing_ok=True)
    proc = mp.get_context("spawn").Process(target=target, args=(payload, str(result)), name=name)
    started = time.perf_counter()
    proc.start()
    try:
        proc.join()
    finally:   # the bench stopped (a signal, Ctrl-C): the side ends with it, not after it (nor keeps it waiting)
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    wall = time.perf_counter() - started
    if proc.exitcode != 0 or not result.exists():
        raise BenchError(f"{what} exited with {proc.exitcode} (its traceback is above)")
    return json.loads(result.read_text()), wall


def train_flag(words: list[str], flag: str) -> str | None:
    """The value of `flag` in the extra ``unison train`` arguments (``--amp bf16`` or ``--amp=bf16``), if given:
    the Lightly side runs under the same autocast as unison's."""
    for k, word in enumerate(words):
        if word == flag and k + 1 < len(words):
            return words[k + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def side_threads(cfg: LabConfig) -> int:
    """Torch threads of each side's training process: --lightly-threads, else every core."""
    return cfg.lightly_threads or (os.cpu_count() or 1)


def compare(cfg: LabConfig, data: str, val: str | None, out_dir: Path) -> list[dict[str, Any]]:
    """For each method of ``--method``: measure unison, then Lightly (when installed); one row per side."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and cfg.backend == "nccl" else "cpu"
    rows: list[dict[str, Any]] = []
    for method in cfg.lightly_method_list:
        for seed in cfg.seed_list:   # each side once per seed: their spread is the noise
            rows += compare_method(for_method(dataclasses.replace(cfg, seed=seed), method), method, data, val,
                                   out_dir, device)
    return rows


def side_run_name(cfg: LabConfig, method: str) -> str:
    """The unison side's run directory under ``runs/`` (one per method and, with --seeds, per seed)."""
    return f"lightly-cmp-{method}-unison" + (f"-seed{cfg.seed}" if len(cfg.seed_list) > 1 else "")


def for_method(cfg: LabConfig, method: str) -> LabConfig:
    """`cfg` for `method`'s comparison: a method that needs patch tokens (MAE) trains the ViT of its recipe on both
    sides when the bench's backbone is a CNN."""
    from unison.methods import get_method

    recipe = get_method(method).recipe.backbone
    if recipe.startswith("vit_") and not cfg.backbone.startswith(("vit_", "timm:")):
        return dataclasses.replace(cfg, backbone=recipe)
    return cfg


def unison_side_argv(cfg: LabConfig, method: str, data: str, val: str | None, run_dir: Path) -> list[str]:
    """``unison train`` of the comparison's unison side: the method's recipe, no warm-up, and the work Lightly's
    side does, no more (no online probe, no label-free signals)."""
    if cfg.lightly_epochs:   # by epochs: the whole --epochs N run, kNN every E epochs
        spec = RunSpec(method, "unison", 1, threads=side_threads(cfg))
        by_epoch = ["--eval-every", str(cfg.lightly_eval_every)] if cfg.lightly_eval_every else []
        cfg = dataclasses.replace(cfg, epochs=cfg.lightly_epochs)
    else:
        spec = RunSpec(method, "unison", 1, threads=side_threads(cfg), max_steps=cfg.lightly_steps)
        by_epoch = []
    return train_argv(cfg, spec, data, val, run_dir) + ["--warmup-epochs", "0", "--no-online-probe",
                                                        "--signal-images", "0", *by_epoch]


def unison_knn_by_epoch(run_dir: Path, steps_per_epoch: int) -> list[list[float]]:
    """[epoch, kNN] of each kNN the unison side logged (its ``--eval-every`` evaluations and the end's)."""
    from unison.plotting import read_metrics

    rows = read_metrics(run_dir / "metrics.csv")
    return [[(r["step"] or 0) / steps_per_epoch, knn] for r in rows if (knn := r.get("knn_top1")) is not None]


def epoch_steps(cfg: LabConfig, summary: dict[str, Any]) -> tuple[int, int]:
    """(steps, steps per epoch) of the unison side's ``--epochs N`` run, for Lightly's side to train as many: its
    DataLoader (drop_last) has the data's size // the batch per epoch; `BenchError` when unison's differs, the
    sides would compare different epochs."""
    steps, n = int(summary["steps"]), int(summary["train_images"])
    per_epoch = n // cfg.batch_size
    if not cfg.lightly_epochs or steps != cfg.lightly_epochs * per_epoch:
        raise BenchError(f"the unison side trained {steps} steps, not {cfg.lightly_epochs} epochs x {per_epoch} "
                         f"({n} images // batch {cfg.batch_size}): the sides would compare different epochs")
    return steps, per_epoch


def compare_method(cfg: LabConfig, method: str, data: str, val: str | None, out_dir: Path,
                   device: str) -> list[dict[str, Any]]:
    threads = side_threads(cfg)
    run_dir = out_dir / "runs" / side_run_name(cfg, method)
    argv = unison_side_argv(cfg, method, data, val, run_dir)
    load = wait_for_load(cfg.max_load, cfg.load_wait_s)
    print(f"unison bench: Lightly comparison, {method}, unison side (load {format_load(load)}) ...", flush=True)
    s, wall = run_train(argv, run_dir)
    by_epoch = epoch_steps(cfg, s) if cfg.lightly_epochs else None
    common = {"method": method, "seed": cfg.seed, "backbone": cfg.backbone, "global_batch": cfg.batch_size,
              "steps": by_epoch[0] if by_epoch else cfg.lightly_steps}
    first_step, first_time = _first_logged_interval(s)
    b, n = cfg.batch_size, s["steps"]
    rows = [{"side": "unison", "pipeline": "uint8 tensor dataset + batched ViewAugmenter + unison's method",
             **common, "threads": threads, "loader_workers": 0, "train_time_s": s["train_time_s"], "wall_s": wall,
             "images_per_s": n * b / s["train_time_s"], "steady_from_step": first_step,
             "steady_images_per_s": (n - first_step) * b / (s["train_time_s"] - first_time)
             if n > first_step else None, "knn_top1": s["knn_top1"], "final_loss": s["final_loss"],
             "peak_memory_mib": max(s["peak_memory_mib"]), "data_wait_share": s["data_wait_fraction"],
             "load_1m": load[0] if load else None,
             "load_1m_after": (loadavg() or [None])[0], "version": package_version("unison"), "error": None,
             "knn_by_epoch": unison_knn_by_epoch(run_dir, by_epoch[1]) if by_epoch else None,
             "command": "unison " + shlex.join(argv)}]
    why_not = lightly_available()
    if why_not is None:
        load = wait_for_load(cfg.max_load, cfg.load_wait_s)
        print(f"unison bench: Lightly comparison, {method}, Lightly side (load {format_load(load)}) ...", flush=True)
        r, wall = run_lightly_side(cfg, method, data, val, out_dir, threads, device, by_epoch)
        ends = r["step_end_s"]
        rows.append({"side": "lightly", "pipeline": f"PIL dataset + Lightly's {method} transform, heads and loss + "
                     f"DataLoader workers ({r['recipe']})", **common, "threads": threads,
                     "loader_workers": cfg.lightly_loader_workers, "train_time_s": r["train_time_s"], "wall_s": wall,
                     "images_per_s": r["steps"] * cfg.batch_size / r["train_time_s"], "steady_from_step": first_step,
                     "steady_images_per_s": (len(ends) - first_step) * cfg.batch_size / (ends[-1] - ends[first_step - 1])
                     if len(ends) > first_step else None, "knn_top1": r["knn_top1"], "final_loss": r["final_loss"],
                     "peak_memory_mib": r["peak_memory_mib"], "data_wait_share": r["data_wait_share"],
                     "knn_by_epoch": r["knn_by_epoch"], "load_1m": load[0] if load else None,
                     "load_1m_after": (loadavg() or [None])[0], "version": package_version("lightly"), "error": None})
    else:
        rows.append({"side": "lightly", "pipeline": "not measured", **common, "error": why_not})
    _add_warmup(rows)
    _add_flops(rows, cfg, method, s["image_size"], device)
    return rows


def _add_warmup(rows: list[dict[str, Any]]) -> None:
    """Each side's warm-up (the steps before the steady window: first step, compile, loader start) in seconds and
    as a share of its training time; above `WARMUP_SHARE` the steady rate is the one to quote."""
    for r in rows:
        if r.get("error") or not r.get("steady_images_per_s"):
            continue
        steady_s = (r["steps"] - r["steady_from_step"]) * r["global_batch"] / r["steady_images_per_s"]
        r["warmup_s"] = max(0.0, r["train_time_s"] - steady_s)
        r["warmup_share"] = r["warmup_s"] / r["train_time_s"]


def _add_flops(rows: list[dict[str, Any]], cfg: LabConfig, method: str, image_size: int, device: str) -> None:
    """Achieved TFLOP/s of each measured side and, on a GPU with a known peak, the fraction of its bf16 peak.

    unison's count (`training_step_flops`) of the method's step; for SimCLR it serves both sides (same backbone,
    projection head and batch), for the others Lightly's heads differ and its side gets none.
    """
    import torch

    from unison.bench.flops import bf16_peak_tflops, matmul_rate, training_step_flops

    try:
        step_flops = training_step_flops(method, cfg.backbone, cfg.batch_size, image_size)
    except (RuntimeError, ValueError):   # a step that reads a host value (SwAV's prototype counter), one view (MAE)
        return
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else None
    peak = cfg.peak_tflops or bf16_peak_tflops(device_name)
    matmul = matmul_rate(side_threads(cfg), device=device) if device == "cpu" else None   # now, same threads
    for r in rows:
        if r.get("error") or (r["side"] == "lightly" and method != "simclr"):
            continue
        r["step_gflop"] = step_flops / 1e9
        r["tflops_per_s"] = step_flops * r["steps"] / r["train_time_s"] / 1e12
        steady = r.get("steady_images_per_s")
        r["steady_tflops_per_s"] = step_flops * steady / cfg.batch_size / 1e12 if steady else None
        r["bf16_peak_tflops"] = peak
        r["peak_fraction"] = r["tflops_per_s"] / peak if peak else None
        r["matmul_tflops_per_s"] = matmul / 1e12 if matmul else None
        r["matmul_fraction"] = (r["steady_tflops_per_s"] or r["tflops_per_s"]) * 1e12 / matmul if matmul else None


def _first_logged_interval(summary: dict[str, Any]) -> tuple[int, float]:
    """(step, seconds) at unison's first regular log (step ``log_every``; the loop also logs step 1, for the
    progress bar): the warm-up interval left out of the steady rate."""
    if not summary["loss_curve"]:
        raise BenchError("the unison side logged no step")
    log_every = TrainConfig().log_every   # train_argv leaves --log-every at its default
    i = next((i for i, (step, _) in enumerate(summary["loss_curve"]) if step >= log_every), 0)
    return int(summary["loss_curve"][i][0]), float(summary["log_times_s"][i])


def package_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "n/a"
