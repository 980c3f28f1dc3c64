"""`unison bench data`: images/s per core of unison's streaming loader against the decoder's limit, torchvision and DALI.

Every side turns the same JPEG folder into SimCLR's two 224 px views of every image with the
same number of loader processes (DALI: threads) and the same batch size; each row is reported
as images/s, images/s per loader process (= per core when there are as many cores), and as a
fraction of the decode limit:

* **decode limit** (`unison.data.jpeg`, libjpeg-turbo called directly): only the decode, in the
  same DataLoader processes, the pixels left there. *Full size*: every image at its stored size;
  *DCT-scaled*: at the 1/2, 1/4 or 1/8 scale unison's loader picks from the two views' crop
  boxes (the same as full size for 300-500 px images whose crops are under 448 px).
* **torchvision** (what Lightly's and torchvision's docs show): ``ImageFolder`` (PIL decode at full
  size) + Lightly's ``SimCLRTransform`` per image and view in the workers — RandomResizedCrop(224,
  scale 0.08-1), horizontal flip, ColorJitter(0.8, 0.8, 0.8, 0.2) with p 0.8, RandomGrayscale(0.2),
  PIL GaussianBlur (sigma 0.1-2) with p 0.5, ToTensor, Normalize — the real one when ``lightly`` is
  installed, else the same torchvision transforms with those defaults; ``DataLoader(shuffle=True,
  drop_last=True, persistent_workers=True)``.
* **DALI, CPU** (what solo-learn uses; only when ``nvidia.dali`` imports — ``pip install
  nvidia-dali-cuda120`` runs without a GPU): ``fn.readers.file`` + ``fn.decoders.image`` on the CPU +
  the same augmentation per sample (random_resized_crop, flip, color_twist with p 0.8, grayscale
  p 0.2, gaussian_blur p 0.5, crop_mirror_normalize), ``device_id=None``, as many threads as the
  other sides have loader processes; otherwise the row says why it did not run.
* **unison** (`StreamingBatches`, ``--data-mode stream``, training on the CPU): the workers read
  each image once, decode JPEGs with libjpeg-turbo at reduced size when the crops allow, crop both
  views from the original-size boxes with antialiasing, and run colour jitter, grayscale, blur and
  normalisation batched over their job (`ViewAugmenter.finish`).
* **unison loader, colour ops on the device**: the same workers' CPU work when training on a GPU,
  where `ViewAugmenter.finish` runs batched on the device: read, decode, crop (uint8 crops).
* **unison, --decode gpu** (only with CUDA): batched nvJPEG decode and crops on the GPU.

Without ``--data-folder`` the images are generated once under the output folder: ImageNet-like
JPEGs of 300-500 px per side (quality 90) and one in eight larger photographs of 1000-2000 px.
Each side runs `data_repeats` times, alternating, after two warm-up batches; the best run counts
(the machine may be shared; the load is in the table).

Example::

    unison bench data --data-loader-workers 4
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unison.data import jpeg
from unison.data.decode import CropDecoder, to_rgb

from .config import BenchConfig, format_load, loadavg

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224
WARMUP_BATCHES = 2
LIMIT = "decode limit: libjpeg-turbo, full size"


class _PilGaussianBlur:
    """Lightly's GaussianBlur: PIL's filter with sigma uniform in `sigmas`, applied with probability `prob`."""

    def __init__(self, prob: float = 0.5, sigmas: tuple[float, float] = (0.1, 2.0)):
        self.prob, self.sigmas = prob, sigmas

    def __call__(self, img):
        from PIL import ImageFilter

        if np.random.random_sample() < self.prob:
            return img.filter(ImageFilter.GaussianBlur(radius=np.random.uniform(*self.sigmas)))
        return img


class _TwoViews:
    def __init__(self, transform: Any):
        self.transform = transform

    def __call__(self, img):
        return [self.transform(img), self.transform(img)]


def simclr_transform() -> tuple[Any, str]:
    """Lightly's SimCLRTransform at 224 px (two views), or the same pipeline written with torchvision."""
    try:
        from lightly.transforms import SimCLRTransform

        return SimCLRTransform(input_size=SIZE), "lightly.transforms.SimCLRTransform(input_size=224)"
    except ImportError:
        import torchvision.transforms as T

        view = T.Compose([T.RandomResizedCrop(SIZE, scale=(0.08, 1.0)), T.RandomHorizontalFlip(),
                          T.RandomApply([T.ColorJitter(0.8, 0.8, 0.8, 0.2)], p=0.8), T.RandomGrayscale(0.2),
                          _PilGaussianBlur(), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        return _TwoViews(view), "torchvision transforms with SimCLRTransform's defaults (lightly not installed)"


def data_folder(cfg: BenchConfig, out: Path) -> str:
    """The benchmark's images: --data-folder, or JPEGs generated once under `out` (300-500 px, and one in eight
    a larger photograph of 1000-2000 px, in a class folder of its own)."""
    if cfg.data_folder:
        return cfg.data_folder
    import shutil
    import tempfile

    from unison.data.generated import write_image_folder

    root = out / f"data-jpegs-{cfg.data_images}"
    if not root.is_dir() or sum(1 for _ in root.rglob("*.jpg")) != cfg.data_images:
        large = cfg.data_images // 8
        print(f"unison bench: writing {cfg.data_images - large} JPEGs of 300-500 px and {large} of 1000-2000 px "
              f"to {root} ...", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        jpeg = (("RGB", "JPEG", ".jpg"),)
        write_image_folder(root, cfg.data_images - large, classes=10, sizes=(300, 500), modes=jpeg)
        if large:
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                write_image_folder(tmp, large, classes=1, sizes=(1000, 2000), seed=1, modes=jpeg)
                shutil.move(str(Path(tmp) / "class_0"), str(root / "large"))
    return str(root)


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and every process below it (the loader processes), from /proc;
    NaN where there is none. Images per CPU-second is the per-core rate, whatever else the machine runs."""
    import os

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, todo, seen = 0.0, [os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            if pid == os.getpid():
                return float("nan")
    return total


def _time_batches(batches: Any, n: int, batch_size: int) -> tuple[float, float]:
    """(images/s, images per CPU-second of this process and its loader processes) over `n` batches after the
    warm-up ones."""
    it = iter(batches)
    for _ in range(WARMUP_BATCHES):
        next(it)
    cpu, started = _cpu_seconds(), time.perf_counter()
    for _ in range(n):
        views = next(it)
        assert len(views) >= 2
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    return n * batch_size / wall, n * batch_size / cpu if cpu > 0 else float("nan")


def _torchvision_side(folder: str, cfg: BenchConfig) -> tuple[float, float]:
    import torchvision

    transform, _ = simclr_transform()
    ds = torchvision.datasets.ImageFolder(folder, transform=transform)
    loader = torch.utils.data.DataLoader(ds, batch_size=cfg.data_batch_size, shuffle=True, drop_last=True,
                                         num_workers=cfg.data_loader_workers, persistent_workers=True,
                                         prefetch_factor=2)

    def forever():
        while True:
            for (views, _) in loader:
                yield views

    return _time_batches(forever(), cfg.data_batches, cfg.data_batch_size)


def _unison_side(folder: str, cfg: BenchConfig, decode: str, device: torch.device,
                 crops_only: bool = False) -> tuple[float, float]:
    from unison.data.augment import ViewAugmenter
    from unison.data.catalog import open_catalog
    from unison.data.stream import StreamingBatches

    source = StreamingBatches(open_catalog(folder), ViewAugmenter("simclr", SIZE, IMAGENET_MEAN, IMAGENET_STD),
                              cfg.data_batch_size, seed=0, device=device, loader_workers=cfg.data_loader_workers,
                              decode=decode)
    if crops_only:  # what the loader processes do when the colour ops run on a GPU: the uint8 crops
        source.decoder.finish = False
        views: Any = (job["crops"] for job in source.loader(0))
    else:
        views = (v for _, _, v in source.iter_from(0))
    rate = _time_batches(views, cfg.data_batches, cfg.data_batch_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return rate


class _DecodeOnly(CropDecoder):
    """The loader's job minus the crops: read, header, boxes, and the libjpeg-turbo decode alone (full size, or at
    the DCT scale the boxes allow); the pixels stay in the worker. The decode limit of `measure`."""

    scaled = False

    def _crop_into(self, im, boxes: list, crops: list, row: int) -> None:
        if not jpeg.handles(im):  # a PNG, a CMYK JPEG... in a --data-folder: PIL's full decode
            to_rgb(im).load()
            return
        W, H = im.size
        reduce = (min(min(b[2] - b[0], b[3] - b[1]) / s for (b, _), s in zip(boxes, self.augment.view_sizes))
                  if self.scaled else 1.0)
        jpeg.decode_scaled(im.fp.getvalue(), W, H, reduce)


def _decode_side(folder: str, cfg: BenchConfig, scaled: bool) -> tuple[float, float]:
    from unison.data.augment import ViewAugmenter
    from unison.data.catalog import open_catalog
    from unison.data.stream import StreamingBatches

    source = StreamingBatches(open_catalog(folder), ViewAugmenter("simclr", SIZE, IMAGENET_MEAN, IMAGENET_STD),
                              cfg.data_batch_size, seed=0, device=torch.device("cpu"),
                              loader_workers=cfg.data_loader_workers)
    source.decoder = _DecodeOnly(source.catalog, source.augment, 0, "error")
    source.decoder.scaled = scaled
    return _time_batches((job["crops"] for job in source.loader(0)), cfg.data_batches, cfg.data_batch_size)


def _dali_side(folder: str, cfg: BenchConfig) -> tuple[float, float]:
    """DALI's CPU pipeline with SimCLR's augmentation; raises ImportError / RuntimeError when DALI cannot run."""
    from nvidia.dali import fn, pipeline_def, types  # not a dependency: `pip install nvidia-dali-cuda120`

    mean, std = [m * 255 for m in IMAGENET_MEAN], [s * 255 for s in IMAGENET_STD]

    def view(images):
        x = fn.random_resized_crop(images, size=(SIZE, SIZE), random_area=(0.08, 1.0),
                                   random_aspect_ratio=(3 / 4, 4 / 3))
        on = fn.random.coin_flip(probability=0.8)  # colour jitter with p 0.8: identity factors when off
        gray = fn.random.coin_flip(probability=0.2)
        jitter = lambda lo, hi, off: on * fn.random.uniform(range=(lo, hi)) + (1 - on) * off  # noqa: E731
        x = fn.color_twist(x, brightness=jitter(0.2, 1.8, 1.0), contrast=jitter(0.2, 1.8, 1.0),
                           saturation=jitter(0.2, 1.8, 1.0) * (1 - gray), hue=jitter(-72.0, 72.0, 0.0))
        if fn.random.coin_flip(probability=0.5):
            x = fn.gaussian_blur(x, sigma=fn.random.uniform(range=(0.1, 2.0)))
        return fn.crop_mirror_normalize(x, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                        mirror=fn.random.coin_flip())

    @pipeline_def(batch_size=cfg.data_batch_size, num_threads=max(1, cfg.data_loader_workers), device_id=None,
                  enable_conditionals=True, prefetch_queue_depth=2, seed=0)
    def simclr():
        jpegs, _ = fn.readers.file(file_root=folder, random_shuffle=True)
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        return view(images), view(images)

    pipe = simclr()
    pipe.build()

    def batches():
        while True:
            yield [torch.from_numpy(out.as_array()) for out in pipe.run()]

    return _time_batches(batches(), cfg.data_batches, cfg.data_batch_size)


def _dali_or_why() -> str | None:
    """None when DALI's CPU pipeline runs here, else why not (one line)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return f"not installed ({e}; pip install nvidia-dali-cuda120 runs it without a GPU)"
    return None


def measure(cfg: BenchConfig, out: Path) -> list[dict[str, Any]]:
    """Rows: one per side, the best images/s of `data_repeats` alternating runs, and the load before each."""
    folder = data_folder(cfg, out)
    cpu = torch.device("cpu")
    sides: list[tuple[str, Any]] = [
        ("decode limit: libjpeg-turbo, full size", lambda: _decode_side(folder, cfg, scaled=False)),
        ("decode limit: libjpeg-turbo, DCT-scaled for the crops", lambda: _decode_side(folder, cfg, scaled=True)),
        ("torchvision", lambda: _torchvision_side(folder, cfg)),
    ]
    dali_missing = _dali_or_why()
    if dali_missing is None:
        sides.append(("DALI, CPU pipeline", lambda: _dali_side(folder, cfg)))
    sides += [("unison", lambda: _unison_side(folder, cfg, "cpu", cpu)),
              ("unison loader, colour ops on the device", lambda: _unison_side(folder, cfg, "cpu", cpu,
                                                                                 crops_only=True))]
    if torch.cuda.is_available():
        sides.append(("unison --decode gpu", lambda: _unison_side(folder, cfg, "gpu", torch.device("cuda"))))
    torch.set_num_threads(cfg.data_threads)
    rates: dict[str, list[float]] = {name: [] for name, _ in sides}
    per_cpu: dict[str, list[float]] = {name: [] for name, _ in sides}
    loads: dict[str, list[str]] = {name: [] for name, _ in sides}
    failed: dict[str, str] = {}
    for rep in range(cfg.data_repeats):
        for name, run in sides:
            if name in failed:
                continue
            loads[name].append(format_load(loadavg()))
            try:
                wall, cpu_rate = run()
                rates[name].append(wall)
                per_cpu[name].append(cpu_rate)
            except Exception as e:  # DALI only (an optional package): the row says why
                if not name.startswith("DALI"):
                    raise
                failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                print(f"unison bench: data, {name} did not run: {failed[name]}", flush=True)
                continue
            print(f"unison bench: data, {name}, run {rep + 1}: {rates[name][-1]:.1f} images/s, "
                  f"{per_cpu[name][-1]:.1f} per CPU-second", flush=True)
    _, pipeline = simclr_transform()
    return _rows(cfg, folder, pipeline, rates, per_cpu, loads, failed, dali_missing)


def _rows(cfg: BenchConfig, folder: str, pipeline: str, rates: dict, cpu: dict, loads: dict, failed: dict,
          dali_missing: str | None) -> list[dict[str, Any]]:
    """One row per side; ratios on images per CPU-second (the per-core rate), and on wall-clock images/s."""
    procs = max(1, cfg.data_loader_workers)
    best = {name: max(runs) if runs else float("nan") for name, runs in rates.items()}
    per_cpu = {name: max(runs) if runs else float("nan") for name, runs in cpu.items()}
    if dali_missing is not None:
        best["DALI, CPU pipeline"] = per_cpu["DALI, CPU pipeline"] = float("nan")
        failed["DALI, CPU pipeline"] = dali_missing
    rows = []
    for name in best:
        rows.append({"side": name, "images_per_s": best[name], "per_process": best[name] / procs,
                     "per_cpu_s": per_cpu[name], "of_decode_limit": per_cpu[name] / per_cpu[LIMIT],
                     "vs_torchvision": per_cpu[name] / per_cpu["torchvision"],
                     "vs_torchvision_wall": best[name] / best["torchvision"],
                     "runs": [round(r, 1) for r in rates.get(name, [])], "loader_workers": cfg.data_loader_workers,
                     "batch_size": cfg.data_batch_size, "batches": cfg.data_batches, "threads": cfg.data_threads,
                     "load_before": loads.get(name, []), "images": folder, "note": failed.get(name, ""),
                     "pipeline": pipeline if name == "torchvision" else ""})
    return rows


def write(rows: list[dict[str, Any]], out: Path, header: str) -> dict[str, Path]:
    from .report import markdown_table, result_paths, write_csv

    def num(x: float, fmt: str) -> str:
        return "-" if x != x else format(x, fmt)  # NaN: the side did not run

    table = markdown_table(
        ["Side", "Images/s (best)", "Per process", "Images per CPU-second", "Of the decode limit",
         "vs torchvision (CPU-s / wall)", "Runs (images/s)", "Processes", "Load before each run"],
        [[r["side"] + (f" ({r['note']})" if r["note"] else ""), num(r["images_per_s"], ".1f"),
          num(r["per_process"], ".1f"), num(r["per_cpu_s"], ".1f"), num(r["of_decode_limit"], ".2f"),
          f"{num(r['vs_torchvision'], '.2f')}x / {num(r['vs_torchvision_wall'], '.2f')}x",
          " / ".join(str(x) for x in r["runs"]), r["loader_workers"], "; ".join(r["load_before"])] for r in rows])
    tv = next(r for r in rows if r["side"] == "torchvision")
    notes = (f"\n{rows[0]['batches']} timed batches of {rows[0]['batch_size']} after {WARMUP_BATCHES} warm-up ones, "
             f"two {SIZE} px views per image, {rows[0]['threads']} torch thread(s) in the training process. Per "
             "process: images/s / loader processes (DALI: threads). Images per CPU-second: the timed images over "
             "the CPU time (user + system) of the training process and its loader processes, the per-core rate "
             "whatever else runs on the machine; the fraction of the decode limit and the first ratio to "
             f"torchvision use it. Decode limit: the row '{LIMIT}'. torchvision side: "
             f"{tv['pipeline']}. Images: {rows[0]['images']}.\n")
    paths = result_paths(out, "data")
    paths["md"].write_text(header + table + notes)
    write_csv(paths["csv"], rows)
    return paths
