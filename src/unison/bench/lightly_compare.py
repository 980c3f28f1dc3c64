"""SimCLR side by side with Lightly SSL: the same backbone, data, global batch and steps.

Lightly's side is its documented pipeline: a map-style dataset that turns each stored
image into a PIL image (what ``torchvision.datasets.CIFAR10.__getitem__`` does) and applies
``lightly.transforms.SimCLRTransform`` per sample, a ``torch.utils.data.DataLoader``
(shuffle, drop_last, worker processes), the backbone + ``SimCLRProjectionHead``, each
view forwarded separately and ``lightly.loss.NTXentLoss``. The transform arguments follow
Lightly's CIFAR-10 settings and match unison's ``simclr`` preset: 32 px crops, colour
jitter strength 0.5 (0.4/0.4/0.4/0.1, p=0.8), grayscale 0.2, flip 0.5, no blur, and the
training set's mean/std.

unison's side is ``unison train --world-size 1`` (uint8 tensor dataset, batched
augmentation on the device, unison's NT-Xent) with the same backbone type
(`unison.models.build_backbone`), images (same subset and seed), global batch, steps,
optimizer (SGD, the SimCLR recipe's learning rate), schedule (cosine, no warm-up) and
temperature (0.5).

Both sides run as one training process each (Lightly's has its DataLoader workers
besides), one after the other, in fresh processes under the benchmark's process. Throughput
= steps x batch / the training loop's time (Lightly's includes starting its loader workers
each epoch, as an epoch does). Both encoders are scored by the same code,
`unison.eval.knn.knn_accuracy` with unison's evaluation transform.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any, cast

from unison.config import TrainConfig
from unison.config.extras import install_command
from unison.errors import BenchError

from .config import BenchConfig, format_load, loadavg, wait_for_load
from .report import fmt_duration, markdown_table, write_csv
from .table import RunSpec, load_pair, run_train, train_argv


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


class _PILImages:
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


def _lightly_child(p: dict[str, Any], result_path: str) -> None:
    import torch
    import torch.nn as nn
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead
    from lightly.transforms import SimCLRTransform
    from torch.utils.data import DataLoader, Dataset

    from unison.data import eval_transform, load_dataset
    from unison.eval.knn import knn_accuracy
    from unison.methods import SimCLR
    from unison.models import build_backbone
    from unison.optim import build_optimizer
    from unison.training.step import Schedule
    from unison.training.summary import peak_memory_mib

    torch.set_num_threads(p["threads"])
    torch.manual_seed(p["seed"])
    device = torch.device(p["device"])
    train = load_dataset(p["data"], "train", subset=p["subset"], seed=p["seed"])
    val = load_dataset(p["val"] or p["data"], "val", subset=p["val_subset"], seed=p["seed"])
    transform = SimCLRTransform(input_size=train.image_size, cj_strength=0.5, gaussian_blur=0.0,
                                normalize={"mean": list(train.mean), "std": list(train.std)})
    # A map-style dataset (__getitem__ + __len__) is all DataLoader needs; its stubs ask for a Dataset subclass.
    images = cast("Dataset[Any]", _PILImages(train.images, train.labels, transform))
    loader: DataLoader[Any] = DataLoader(images, batch_size=p["batch_size"], shuffle=True, drop_last=True,
                                         num_workers=p["loader_workers"], pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(p["seed"]))

    class LightlySimCLR(nn.Module):   # as in Lightly's SimCLR example
        def __init__(self, backbone: nn.Module, dim: int):
            super().__init__()
            self.backbone = backbone
            self.projection_head = SimCLRProjectionHead(dim, 512, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.projection_head(self.backbone(x).flatten(start_dim=1))

    backbone, dim = build_backbone(p["backbone"])
    model = LightlySimCLR(backbone, dim).to(device)
    criterion = NTXentLoss(temperature=0.5)
    peak_lr = SimCLR.recipe.base_lr * p["batch_size"] / 256
    optimizer = build_optimizer("sgd", model.parameters(), lr=peak_lr, weight_decay=SimCLR.recipe.weight_decay)
    steps = p["steps"]
    schedule = Schedule(peak_lr, warmup_steps=0, total_steps=steps)   # unison's schedule, so both sides match
    step_end, wait_s, final_loss = _train_lightly(model, loader, criterion, optimizer, schedule, p, device)
    train_time = step_end[-1]

    model.eval()
    to_eval = lambda x: eval_transform(x, train.image_size, train.mean, train.std)  # noqa: E731
    knn = knn_accuracy(model.backbone, train.images.to(device), train.labels.to(device), val.images.to(device),
                       val.labels.to(device), to_eval, len(train.classes), k=p["knn_k"], t=0.1)
    Path(result_path).write_text(json.dumps({
        "steps": steps, "train_time_s": train_time, "step_end_s": step_end, "knn_top1": knn, "final_loss": final_loss,
        "data_wait_share": wait_s / train_time,
        "peak_memory_mib": peak_memory_mib(device), "train_images": len(train), "val_images": len(val)}))


def _train_lightly(model, loader, criterion, optimizer, schedule, p: dict[str, Any], device) -> tuple:
    """Lightly's training loop: (seconds since the start at the end of every step, seconds blocked on the loader
    for the next batch (its data wait), the final loss)."""
    import torch

    step_end: list[float] = []
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
            (x0, x1), _ = batch
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            x0, x1 = x0.to(device, non_blocking=True), x1.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=p["amp"] == "bf16"):
                loss = criterion(model(x0), model(x1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_end.append(time.perf_counter() - started)
    return step_end, wait_s, float(loss.detach())


def run_lightly_side(cfg: BenchConfig, data: str, val: str | None, out_dir: Path, threads: int,
                     device: str) -> tuple[dict[str, Any], float]:
    payload = {"data": data, "val": val, "subset": cfg.subset, "val_subset": cfg.val_subset, "seed": cfg.seed,
               "batch_size": cfg.batch_size, "steps": cfg.lightly_steps, "backbone": cfg.backbone,
               "loader_workers": cfg.lightly_loader_workers, "threads": threads, "knn_k": cfg.knn_k, "device": device,
               "amp": train_flag(cfg.train_args, "--amp") or "none"}
    result = out_dir / "lightly_side.json"
    result.unlink(missing_ok=True)
    proc = mp.get_context("spawn").Process(target=_lightly_child, args=(payload, str(result)), name="lightly-side")
    started = time.perf_counter()
    proc.start()
    proc.join()
    wall = time.perf_counter() - started
    if proc.exitcode != 0 or not result.exists():
        raise BenchError(f"the Lightly side exited with {proc.exitcode} (its traceback is above)")
    return json.loads(result.read_text()), wall


def train_flag(train_args: str, flag: str) -> str | None:
    """The value of `flag` in the extra ``unison train`` arguments (``--amp bf16`` or ``--amp=bf16``), if given:
    the Lightly side runs under the same autocast as unison's."""
    import shlex

    words = shlex.split(train_args)
    for k, word in enumerate(words):
        if word == flag and k + 1 < len(words):
            return words[k + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def side_threads(cfg: BenchConfig) -> int:
    """Torch threads of each side's training process: --lightly-threads, else every core."""
    return cfg.lightly_threads or (os.cpu_count() or 1)


def compare(cfg: BenchConfig, data: str, val: str | None, out_dir: Path) -> list[dict[str, Any]]:
    """Measure unison, then Lightly (when installed); one row per side."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    threads = side_threads(cfg)
    device = "cuda" if torch.cuda.is_available() and cfg.backend == "nccl" else "cpu"
    common = {"backbone": cfg.backbone, "global_batch": cfg.batch_size, "steps": cfg.lightly_steps}
    rows = []

    spec = RunSpec("simclr", "unison", 1, threads=threads, max_steps=cfg.lightly_steps)
    # the work Lightly's side does, no more: no online probe, no label-free signals
    argv = train_argv(cfg, spec, data, val, out_dir / "runs" / "lightly-cmp-unison") + [
        "--warmup-epochs", "0", "--no-online-probe", "--signal-images", "0"]
    load = wait_for_load(cfg.max_load, cfg.load_wait_s)
    print(f"unison bench: Lightly comparison, unison side (load {format_load(load)}) ...", flush=True)
    run_dir = out_dir / "runs" / "lightly-cmp-unison"
    s, wall = run_train(argv, run_dir)
    first_step, first_time = _first_logged_interval(s)
    b, n = cfg.batch_size, s["steps"]
    rows.append({"side": "unison", "pipeline": "uint8 tensor dataset + batched ViewAugmenter + unison NTXentLoss",
                 **common, "threads": threads, "loader_workers": 0, "train_time_s": s["train_time_s"], "wall_s": wall,
                 "images_per_s": n * b / s["train_time_s"], "steady_from_step": first_step,
                 "steady_images_per_s": (n - first_step) * b / (s["train_time_s"] - first_time)
                 if n > first_step else None, "knn_top1": s["knn_top1"],
                 "peak_memory_mib": max(s["peak_memory_mib"]), "data_wait_share": s["data_wait_fraction"],
                 "load_1m": load[0] if load else None,
                 "load_1m_after": (loadavg() or [None])[0], "version": _version("unison"), "error": None})

    why_not = lightly_available()
    if why_not is None:
        load = wait_for_load(cfg.max_load, cfg.load_wait_s)
        print(f"unison bench: Lightly comparison, Lightly side (load {format_load(load)}) ...", flush=True)
        r, wall = run_lightly_side(cfg, data, val, out_dir, threads, device)
        ends = r["step_end_s"]
        rows.append({"side": "lightly", "pipeline": "PIL dataset + SimCLRTransform + DataLoader workers + "
                     "SimCLRProjectionHead + NTXentLoss", **common, "threads": threads,
                     "loader_workers": cfg.lightly_loader_workers, "train_time_s": r["train_time_s"], "wall_s": wall,
                     "images_per_s": r["steps"] * cfg.batch_size / r["train_time_s"], "steady_from_step": first_step,
                     "steady_images_per_s": (len(ends) - first_step) * cfg.batch_size / (ends[-1] - ends[first_step - 1])
                     if len(ends) > first_step else None, "knn_top1": r["knn_top1"],
                     "peak_memory_mib": r["peak_memory_mib"], "data_wait_share": r["data_wait_share"],
                     "load_1m": load[0] if load else None,
                     "load_1m_after": (loadavg() or [None])[0], "version": _version("lightly"), "error": None})
    else:
        rows.append({"side": "lightly", "pipeline": "not measured", **common, "error": why_not})
    _add_warmup(rows)
    _add_flops(rows, cfg, s["image_size"], device)
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


def _add_flops(rows: list[dict[str, Any]], cfg: BenchConfig, image_size: int, device: str) -> None:
    """Achieved TFLOP/s of each measured side and, on a GPU with a known peak, the fraction of its bf16 peak.

    Both sides do the same matrix work per step (same backbone, projection head and batch), so one count
    from `training_step_flops` serves both.
    """
    import torch

    from .flops import bf16_peak_tflops, matmul_rate, training_step_flops

    step_flops = training_step_flops("simclr", cfg.backbone, cfg.batch_size, image_size)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else None
    peak = cfg.peak_tflops or bf16_peak_tflops(device_name)
    matmul = matmul_rate(side_threads(cfg), device=device) if device == "cpu" else None   # now, same threads
    for r in rows:
        if r.get("error"):
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


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "n/a"


WARMUP_SHARE = 0.05   # a side's warm-up above this share of its time: the all-steps rate understates it


def lightly_markdown(rows: list[dict[str, Any]]) -> str:
    steady_from = next((r.get("steady_from_step") for r in rows if r.get("steady_from_step")), None)
    headers = ["Side", "Version", "Pipeline", "Threads", "Loader workers", "Steps x batch", "Training time",
               "Warm-up", f"img/s (steady, after step {steady_from})", "img/s (all steps)", "TFLOP/s (steady)",
               "of measured fp32 matmul", "of bf16 peak", "Data wait", "kNN acc", "Peak mem", "Load 1 min before / after"]
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["side"], "-", f"not measured: {r['error']}"] + ["-"] * (len(headers) - 3))
            continue
        steady = r.get("steady_images_per_s")
        warmup = "n/a" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f} s ({100 * r['warmup_share']:.0f} %)"
        tflops = r.get("steady_tflops_per_s") or r.get("tflops_per_s")
        body.append([r["side"], r["version"], r["pipeline"], r["threads"], r["loader_workers"],
                     f"{r['steps']} x {r['global_batch']}", fmt_duration(r["train_time_s"]), warmup,
                     "n/a" if steady is None else f"{steady:.1f}", f"{r['images_per_s']:.1f}",
                     "n/a" if tflops is None else f"{tflops:.3f}",
                     "n/a" if r.get("matmul_fraction") is None else f"{100 * r['matmul_fraction']:.0f} %",
                     "n/a (peak unknown)" if r.get("peak_fraction") is None else f"{100 * r['peak_fraction']:.1f} %",
                     "n/a" if r.get("data_wait_share") is None else f"{100 * r['data_wait_share']:.0f} %",
                     f"{r['knn_top1']:.3f}", f"{r['peak_memory_mib']:.0f} MiB", load_pair(r)])
    text = markdown_table(headers, body)
    measured = {r["side"]: r for r in rows if not r.get("error")}
    if "unison" in measured and "lightly" in measured:
        u, lt = measured["unison"], measured["lightly"]
        text += "\n**Throughput ratio unison / Lightly: "
        if u.get("steady_images_per_s") and lt.get("steady_images_per_s"):
            text += f"{u['steady_images_per_s'] / lt['steady_images_per_s']:.2f}x at steady state** (after step " \
                    f"{steady_from}), "
        else:
            text += "** "
        text += (f"{u['images_per_s'] / lt['images_per_s']:.2f}x over all steps (images/s of the training loop; all "
                 "steps include each side's warm-up and, for Lightly, starting its loader workers at every epoch).\n")
        long_warmup = [r["side"] for r in (u, lt) if (r.get("warmup_share") or 0) > WARMUP_SHARE]
        if long_warmup:
            text += (f"\nThe warm-up is over {WARMUP_SHARE:.0%} of the time of {' and '.join(long_warmup)}: quote the "
                     "steady rate, or raise --lightly-steps.\n")
    flop_row = next((r for r in rows if r.get("step_gflop")), None)
    if flop_row is not None:
        peak, matmul = flop_row.get("bf16_peak_tflops"), flop_row.get("matmul_tflops_per_s")
        text += (f"\nTFLOP/s: {flop_row['step_gflop']:.1f} GFLOP of matrix work per step (forward + backward, "
                 "counted by `torch.utils.flop_counter` via `unison.bench.flops`) x steady images/s / batch"
                 + (f"; of measured fp32 matmul: against {matmul * 1e3:.0f} GFLOP/s, the best `torch.mm` (1024, 2048) "
                    "with the sides' threads, measured in this run" if matmul else "")
                 + (f"; of bf16 peak: against {peak:g} TFLOPS dense bf16.\n" if peak else
                    "; no bf16 peak is known for this device (CPU, or a GPU not in `BF16_PEAK_TFLOPS`; "
                    "pass --peak-tflops).\n"))
    return text


def write_lightly(rows: list[dict[str, Any]], out_dir: Path, header: str = "") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "lightly.md", "csv": out_dir / "lightly.csv"}
    paths["md"].write_text(header + lightly_markdown(rows))
    write_csv(paths["csv"], rows)
    return paths
