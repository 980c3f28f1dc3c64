"""`unison bench data`: images/s of unison's streaming loader against torchvision's documented pipeline.

Both sides turn the same JPEG folder into SimCLR's two 224 px views of every image, normalised
float tensors in the training process, with the same number of DataLoader worker processes and
the same batch size:

* **torchvision** (what Lightly's and torchvision's docs show): ``ImageFolder`` (PIL decode at full
  size) + Lightly's ``SimCLRTransform`` per image and view in the workers — RandomResizedCrop(224,
  scale 0.08-1), horizontal flip, ColorJitter(0.8, 0.8, 0.8, 0.2) with p 0.8, RandomGrayscale(0.2),
  PIL GaussianBlur (sigma 0.1-2) with p 0.5, ToTensor, Normalize — the real one when ``lightly`` is
  installed, else the same torchvision transforms with those defaults; ``DataLoader(shuffle=True,
  drop_last=True, persistent_workers=True)``.
* **unison** (`StreamingBatches`, ``--data-mode stream``, training on the CPU): the workers read
  each image once, decode JPEGs at reduced size when the crops allow, crop both views from the
  original-size boxes with antialiasing, and run colour jitter, grayscale, blur and normalisation
  batched over their job (`ViewAugmenter.finish`).
* **unison loader, colour ops on the GPU**: the same workers' CPU work when training on a GPU,
  where `ViewAugmenter.finish` runs batched on the device: read, decode, crop (uint8 crops).
* **unison, --decode gpu** (only with CUDA): batched nvJPEG decode and crops on the GPU.

Without ``--data-folder`` the images are generated once (ImageNet-like: 300-500 px per side, JPEG
quality 90) under the output folder. Each side runs `data_repeats` times, alternating, after two
warm-up batches; the best run counts (the machine may be shared; the load is in the table).

Example::

    unison bench data --data-loader-workers 4
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import BenchConfig, format_load, loadavg

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224
WARMUP_BATCHES = 2


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
    """The benchmark's images: --data-folder, or ImageNet-like JPEGs generated once under `out`."""
    if cfg.data_folder:
        return cfg.data_folder
    from unison.data.generated import write_image_folder

    root = out / f"data-images-{cfg.data_images}"
    if not root.is_dir() or sum(1 for _ in root.rglob("*.jpg")) != cfg.data_images:
        print(f"unison bench: writing {cfg.data_images} JPEGs of 300-500 px to {root} ...", flush=True)
        write_image_folder(root, cfg.data_images, classes=10, sizes=(300, 500), modes=(("RGB", "JPEG", ".jpg"),))
    return str(root)


def _time_batches(batches: Any, n: int, batch_size: int) -> float:
    """images/s over `n` batches after the warm-up ones."""
    it = iter(batches)
    for _ in range(WARMUP_BATCHES):
        next(it)
    started = time.perf_counter()
    for _ in range(n):
        views = next(it)
        assert len(views) >= 2
    return n * batch_size / (time.perf_counter() - started)


def _torchvision_side(folder: str, cfg: BenchConfig) -> float:
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


def _unison_side(folder: str, cfg: BenchConfig, decode: str, device: torch.device, crops_only: bool = False) -> float:
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


def measure(cfg: BenchConfig, out: Path) -> list[dict[str, Any]]:
    """Rows: one per side, the best images/s of `data_repeats` alternating runs, and the load before each."""
    folder = data_folder(cfg, out)
    sides: list[tuple[str, Any]] = [
        ("torchvision", lambda: _torchvision_side(folder, cfg)),
        ("unison", lambda: _unison_side(folder, cfg, "cpu", torch.device("cpu"))),
        ("unison loader, colour ops on the GPU", lambda: _unison_side(folder, cfg, "cpu", torch.device("cpu"),
                                                                      crops_only=True)),
    ]
    if torch.cuda.is_available():
        sides.append(("unison --decode gpu", lambda: _unison_side(folder, cfg, "gpu", torch.device("cuda"))))
    torch.set_num_threads(cfg.data_threads)
    rates: dict[str, list[float]] = {name: [] for name, _ in sides}
    loads: dict[str, list[str]] = {name: [] for name, _ in sides}
    for rep in range(cfg.data_repeats):
        for name, run in sides:
            loads[name].append(format_load(loadavg()))
            rates[name].append(run())
            print(f"unison bench: data, {name}, run {rep + 1}: {rates[name][-1]:.1f} images/s", flush=True)
    _, pipeline = simclr_transform()
    base = max(rates["torchvision"])
    return [{"side": name, "images_per_s": max(rates[name]), "runs": [round(r, 1) for r in rates[name]],
             "vs_torchvision": max(rates[name]) / base, "loader_workers": cfg.data_loader_workers,
             "batch_size": cfg.data_batch_size, "batches": cfg.data_batches, "threads": cfg.data_threads,
             "load_before": loads[name], "images": folder,
             "pipeline": pipeline if name == "torchvision" else "StreamingBatches + ViewAugmenter('simclr')"}
            for name, _ in sides]


def write(rows: list[dict[str, Any]], out: Path, header: str) -> dict[str, Path]:
    from .report import markdown_table, write_csv

    table = markdown_table(
        ["Side", "Images/s (best)", "Runs", "vs torchvision", "Loader workers", "Batch", "Load before each run"],
        [[r["side"], f"{r['images_per_s']:.1f}", " / ".join(str(x) for x in r["runs"]), f"{r['vs_torchvision']:.2f}x",
          r["loader_workers"], r["batch_size"], "; ".join(r["load_before"])] for r in rows])
    notes = (f"\n{rows[0]['batches']} timed batches after {WARMUP_BATCHES} warm-up ones, two {SIZE} px views per "
             f"image, {rows[0]['threads']} torch thread(s) in the training process. torchvision side: "
             f"{rows[0]['pipeline']}. Images: {rows[0]['images']}.\n")
    paths = {"md": out / "data.md", "csv": out / "data.csv"}
    paths["md"].write_text(header + table + notes)
    write_csv(paths["csv"], rows)
    return paths
