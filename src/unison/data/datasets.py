"""In-memory image datasets: every image decoded once into one uint8 tensor.

`load_dataset(spec, split)` returns an `ImageTensorDataset` whose ``images`` are
uint8 ``[N, 3, H, W]`` (contiguous) and ``labels`` int64 ``[N]``. Training moves it
to the accelerator once (``ds.to("cuda")``) and augments batches there
(`unison.data.augment`), with no DataLoader: for CIFAR-scale data this is the
fastest known pattern and keeps augmentation independent of worker counts.

Specs
-----
``"digits"``   scikit-learn's 1797 8x8 digits (bundled, no download): 0..16 scaled to
               0..255, bilinearly upsampled to 16x16, replicated to RGB. A fixed
               stratified 80/20 split: ``split="train"`` (1438) / ``"val"`` (359),
               the same for every ``seed``.
``"cifar10"``  torchvision's CIFAR-10 in ``root`` (default ``~/.cache/unison/cifar10``),
               downloaded if needed; ``"train"`` = official train set, ``"val"``/``"test"``
               = official test set.
a folder       torchvision ImageFolder layout ``<dir>/<class>/<image>`` (nested folders
               inside a class are searched too). ``split`` is ignored: pass the train
               and the val folder separately. Classes are the sorted subfolder names
               (empty classes are kept so that indices agree across splits).

Folder loading
--------------
* Decoding uses `torchvision.io.decode_image` (JPEG/PNG/WebP/GIF), with PIL as the
  fallback for other formats, in a thread pool; images are converted to RGB.
* All images must share one size: images of another size are resized (bilinear,
  antialiased) to the size of the first image in file order, with one warning.
* Unreadable images: ``on_corrupt="skip"`` drops them with one warning (count and
  first paths); ``on_corrupt="error"`` raises `DataError` naming the file.
* Full loads are cached as a tensor file under ``$UNISON_CACHE_DIR`` (default
  ``~/.cache/unison``), keyed by the folder path and every file's name, size and
  mtime, so a changed folder is decoded again. Set ``UNISON_NO_CACHE=1`` to disable.
  The cache is never written inside the data folder.
* ``subset=n`` picks n files class-balanced (a class with too few images gives
  its share to the others), determined by ``seed`` and the file list only; a
  subset load decodes only the chosen files (unreadable ones are then dropped).

mean / std: per-channel statistics in [0, 1] units, computed from the returned
images for folders, from the full train split for digits (so both splits share
them), and the standard constants for ``"cifar10"``. Evaluate with the *train*
dataset's mean/std.

Example::

    train = load_dataset("../shared/data/cifar10/train", subset=5000).to("cuda")
    val = load_dataset("../shared/data/cifar10/val").to("cuda")
    x = train.images[idx]                       # uint8 [B, 3, 32, 32] on the GPU
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from unison.errors import DataError

from .random import _key, hash64

__all__ = ["DataError", "IMG_EXTENSIONS", "ImageTensorDataset", "balanced_subset", "load_dataset"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # official train set, per pixel
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_CACHE_VERSION = 1
_SPLIT_SEED = 0x5D1617  # fixed: the digits split never depends on `seed`
_SUBSET_STREAM = 0x5B5E7


@dataclass
class ImageTensorDataset:
    images: torch.Tensor  # uint8 [N, 3, H, W], contiguous
    labels: torch.Tensor  # int64 [N]
    classes: list[str]
    mean: tuple[float, float, float]  # per channel, [0, 1] units
    std: tuple[float, float, float]
    name: str

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4 or self.images.shape[1] != 3:
            raise ValueError(f"images must be uint8 [N, 3, H, W], got {self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must be [{self.images.shape[0]}], got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def image_size(self) -> int:
        return self.images.shape[-1]

    def to(self, device: torch.device | str) -> ImageTensorDataset:
        return dataclasses.replace(self, images=self.images.to(device), labels=self.labels.to(device))


def load_dataset(
    spec: str,
    split: str = "train",
    *,
    subset: int | None = None,
    on_corrupt: str = "skip",
    root: str | None = None,
    seed: int = 0,
) -> ImageTensorDataset:
    """Load ``"digits"``, ``"cifar10"`` or an ImageFolder directory into memory (see the module docstring).

    split: ``"train"`` or ``"val"`` for digits/cifar10; ignored for folders. subset: n class-balanced
    images chosen by ``seed``. on_corrupt: ``"skip"`` (warn once) or ``"error"``. root: download folder
    for ``"cifar10"`` only. Raises `DataError` with a one-line message saying what to fix.
    """
    if on_corrupt not in ("skip", "error"):
        raise DataError(f"on_corrupt must be 'skip' or 'error', got {on_corrupt!r}")
    if subset is not None and subset <= 0:
        raise DataError(f"subset must be a positive number of images, got {subset}")
    if spec == "digits":
        ds = _load_digits(split)
    elif spec == "cifar10":
        ds = _load_cifar10(split, root)
    else:
        return _load_folder(Path(spec), subset, on_corrupt, seed)
    if subset is not None:
        keep = balanced_subset(ds.labels, subset, seed)
        ds = dataclasses.replace(ds, images=ds.images[keep].contiguous(), labels=ds.labels[keep])
    return ds


# -- subsets and statistics -------------------------------------------------------------------------
def balanced_subset(labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Sorted indices of n samples, as equal per class as possible, a pure function of (labels, n, seed)."""
    N = labels.shape[0]
    if n > N:
        raise DataError(f"subset={n} is larger than the dataset ({N} images)")
    labels = labels.cpu()
    order = torch.argsort(hash64(_key(seed, _SUBSET_STREAM), torch.arange(N), 1)[:, 0], stable=True)
    lab = labels[order]
    by_class = torch.argsort(lab, stable=True)  # random order within each class
    counts = torch.bincount(lab)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(N, dtype=torch.int64)
    rank[by_class] = torch.arange(N) - starts[lab[by_class]]  # position within its class
    n_cls = counts.numel()
    cls_order = torch.argsort(hash64(_key(seed, _SUBSET_STREAM, 1), torch.arange(n_cls), 1)[:, 0], stable=True)
    cls_pos = torch.empty(n_cls, dtype=torch.int64)
    cls_pos[cls_order] = torch.arange(n_cls)  # which classes get the remainder
    # Round-robin over classes: the k-th image of every class before the (k+1)-th of any.
    pick = torch.argsort(rank * n_cls + cls_pos[lab], stable=True)[:n]
    return torch.sort(order[pick]).values


def _channel_stats(images: torch.Tensor, max_images: int = 10_000) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std in [0, 1] units from pixel histograms of up to `max_images` evenly spaced images."""
    step = max(1, -(-images.shape[0] // max_images))
    x = images[::step].cpu().transpose(0, 1).reshape(3, -1)
    hist = torch.stack([torch.bincount(x[c], minlength=256) for c in range(3)]).to(torch.float64)
    v = torch.arange(256, dtype=torch.float64) / 255
    n = hist.sum(1).clamp_min(1)
    mean = (hist * v).sum(1) / n
    std = ((hist * (v - mean[:, None]) ** 2).sum(1) / n).sqrt()
    return tuple(round(float(m), 6) for m in mean), tuple(round(float(s), 6) for s in std)


# -- digits -------------------------------------------------------------------------------------------
def _load_digits(split: str) -> ImageTensorDataset:
    if split not in ("train", "val"):
        raise DataError(f"digits has splits 'train' and 'val', got {split!r}")
    images, labels = _digits_all()
    is_val = _stratified_val_mask(labels, 0.2)
    mean, std = _channel_stats(images[~is_val])
    keep = is_val if split == "val" else ~is_val
    return ImageTensorDataset(
        images[keep].contiguous(), labels[keep], [str(c) for c in range(10)], mean, std, f"digits-{split}"
    )


def _digits_all() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as uint8 [N, 3, 16, 16] and int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images).to(torch.float32)[:, None] * (255 / 16)  # [N, 1, 8, 8], 0..255
    # Bilinear (not nearest): smooth strokes survive random crops/rotations better than 2x2 blocks.
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    images = x.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    return images, torch.from_numpy(d.target).to(torch.int64)


def _stratified_val_mask(labels: torch.Tensor, frac: float) -> torch.Tensor:
    """round(frac * n_c) random samples of every class c, fixed by _SPLIT_SEED."""
    keys = hash64(_key(_SPLIT_SEED), torch.arange(labels.shape[0]), 1)[:, 0]
    mask = torch.zeros(labels.shape[0], dtype=torch.bool)
    for c in labels.unique().tolist():  # 10 classes: a loop over classes, not samples
        members = (labels == c).nonzero()[:, 0]
        chosen = members[torch.argsort(keys[members], stable=True)[: round(frac * members.numel())]]
        mask[chosen] = True
    return mask


# -- CIFAR-10 via torchvision ---------------------------------------------------------------------------
def _load_cifar10(split: str, root: str | None) -> ImageTensorDataset:
    if split not in ("train", "val", "test"):
        raise DataError(f"cifar10 has splits 'train' and 'val' (= the official test set), got {split!r}")
    from torchvision.datasets import CIFAR10

    path = Path(root).expanduser() if root else _cache_dir() / "cifar10"
    try:
        ds = CIFAR10(str(path), train=split == "train", download=True)
    except Exception as e:  # no network, proxy, disk full...: say what to do instead
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"could not download CIFAR-10 to {path} ({msg}); without network use a local copy as an ImageFolder "
            "(--data DIR with DIR/<class>/<image> files, --val the same for the held-out images)"
        ) from e
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    labels = torch.as_tensor(ds.targets, dtype=torch.int64)
    return ImageTensorDataset(images, labels, list(ds.classes), CIFAR10_MEAN, CIFAR10_STD, f"cifar10-{split}")


# -- ImageFolder ----------------------------------------------------------------------------------------
def _cache_dir() -> Path:
    return Path(os.environ.get("UNISON_CACHE_DIR") or Path.home() / ".cache" / "unison").expanduser()


def _scan(root: Path, with_stat: bool) -> tuple[list[str], list[str], list[int], list]:
    """Classes, sorted relative file paths, labels and (size, mtime_ns) of an ImageFolder tree."""
    layout = f"expected an ImageFolder layout {root}/<class>/<image>"
    if not root.exists():
        raise DataError(f"data folder {root} does not exist ({layout}, or the name 'digits' or 'cifar10')")
    if not root.is_dir():
        raise DataError(f"data path {root} is not a folder ({layout})")
    entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
    classes = sorted(e.name for e in entries if e.is_dir())
    if not entries:
        raise DataError(f"data folder {root} is empty ({layout})")
    if not classes:
        raise DataError(f"data folder {root} has no class subfolders ({layout})")
    files, labels, stats = [], [], []
    for label, cls in enumerate(classes):
        found = []
        for dirpath, dirnames, names in os.walk(root / cls, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, root)  # once per directory, not per file
            found += [os.path.join(rel_dir, n) for n in names if n.lower().endswith(IMG_EXTENSIONS)]
        found.sort()
        files += found
        labels += [label] * len(found)
    if with_stat:
        for rel in files:
            st = os.stat(os.path.join(root, rel))
            stats.append((st.st_size, st.st_mtime_ns))
    if not files:
        exts = ", ".join(IMG_EXTENSIONS[:3])
        raise DataError(f"no image files ({exts}, ...) in the class subfolders of {root} ({layout})")
    empty = sorted(set(classes) - {classes[i] for i in set(labels)})
    if empty:
        warnings.warn(f"{root}: class folder(s) without images kept as classes: {empty[:5]}", stacklevel=4)
    return classes, files, labels, stats


def scan_folder(root: Path) -> list[str]:
    """The sorted relative image paths of an ImageFolder tree (raises `DataError` for a bad layout)."""
    return _scan(root, with_stat=False)[1]


@functools.cache
def _tv_decoder():
    """torchvision's decoder, imported on first use: importing torchvision costs seconds per process."""
    try:  # deprecated in torchvision 0.29 in favour of TorchCodec; PIL remains the fallback once it is gone
        from torchvision.io import ImageReadMode, decode_image

        return decode_image, ImageReadMode
    except ImportError:  # pragma: no cover
        return None


def _decode(path: str) -> torch.Tensor:
    """uint8 [3, H, W] RGB; raises on unreadable files."""
    with open(path, "rb") as f:
        data = f.read()
    decoder = _tv_decoder()
    if decoder is not None:
        try:  # fast path (libjpeg-turbo / libpng, releases the GIL; about 2x PIL on small JPEGs)
            img = decoder[0](torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=decoder[1].RGB)
            if img.dtype != torch.uint8 and img.element_size() == 2:  # 16-bit PNG (torchvision >= 0.21)
                img = (img.to(torch.int32) >> 8).to(torch.uint8)
            if img.dtype == torch.uint8 and img.ndim == 3 and img.shape[0] == 3:
                return img
        except Exception:
            pass
    from PIL import Image  # other formats (BMP, TIFF, PPM, ...); raises on corrupt data

    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
    import numpy as np

    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous()


def _reference_size(root: Path, files: list[str]) -> tuple[int, int]:
    """(H, W) of the first file whose header reads, in file order (subset-independent)."""
    from PIL import Image

    for rel in files:
        try:
            with Image.open(root / rel) as im:
                w, h = im.size
            return h, w
        except Exception:
            continue
    raise DataError(f"no readable images in {root} (every file failed to open)")


def _decode_all(root: Path, files: list[str], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, list, int]:
    """Decode files into uint8 [n_ok, 3, H, W]; returns (images, row index per file or -1, errors, n_resized)."""
    n = len(files)
    out = torch.empty((n, 3, *size), dtype=torch.uint8)
    ok = torch.zeros(n, dtype=torch.bool)

    def work(lo: int, hi: int) -> tuple[list[tuple[str, str]], int]:
        errors, resized = [], 0
        for i in range(lo, hi):
            try:
                img = _decode(os.path.join(root, files[i]))
            except Exception as e:
                errors.append((files[i], f"{type(e).__name__}: {e}".splitlines()[0][:200]))
                continue
            if tuple(img.shape[1:]) != size:
                x = F.interpolate(img[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)
                img = x[0].round().clamp(0, 255).to(torch.uint8)
                resized += 1
            out[i] = img  # disjoint rows per task: no lock needed
            ok[i] = True
        return errors, resized

    chunk = 256  # per-task overhead matters for tiny JPEGs
    with warnings.catch_warnings(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        # torchvision >= 0.29 emits a DeprecationWarning per decode call (TorchCodec migration).
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.io")
        results = list(pool.map(lambda lo: work(lo, min(lo + chunk, n)), range(0, n, chunk)))
    errors = sorted(e for errs, _ in results for e in errs)
    resized = sum(r for _, r in results)
    rows = torch.full((n,), -1, dtype=torch.int64)
    rows[ok] = torch.arange(int(ok.sum()))
    images = out if bool(ok.all()) else out[ok].contiguous()
    return images, rows, errors, resized


def _cache_file(root: Path, files: list[str], stats: list) -> Path | None:
    if os.environ.get("UNISON_NO_CACHE", "") not in ("", "0"):
        return None
    cache = _cache_dir().resolve()
    if cache == root or root in cache.parents:  # never write into the data folder
        return None
    blob = json.dumps([_CACHE_VERSION, str(root), files, stats]).encode()
    digest = hashlib.sha256(blob).hexdigest()[:20]
    return cache / "images" / f"{root.parent.name}-{root.name}-{digest}.pt"


def _read_cache(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True, mmap=True)
        return data if set(data) == {"images", "rows", "errors", "resized"} else None
    except Exception:  # truncated / from another version: decode again
        return None


def _write_cache(path: Path | None, data: dict) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(data, tmp)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a partial file
    except OSError as e:
        warnings.warn(f"could not write the image cache {path}: {e}", stacklevel=3)


def _load_folder(path: Path, subset: int | None, on_corrupt: str, seed: int) -> ImageTensorDataset:
    root = path.expanduser().resolve()
    classes, files, labels_list, stats = _scan(root, with_stat=True)
    labels = torch.tensor(labels_list, dtype=torch.int64)
    cache_path = _cache_file(root, files, stats)
    sel = balanced_subset(labels, subset, seed) if subset is not None else None
    cached = _read_cache(cache_path)
    if cached is not None:
        images, rows, errors, resized = cached["images"], cached["rows"], cached["errors"], cached["resized"]
    else:
        size = _reference_size(root, files)
        todo = files if sel is None else [files[i] for i in sel.tolist()]
        images, rows, errors, resized = _decode_all(root, todo, size)
        if sel is None:
            _write_cache(cache_path, dict(images=images, rows=rows, errors=errors, resized=resized))
        else:  # rows are relative to the subset: express them over all files
            full = torch.full((len(files),), -1, dtype=torch.int64)
            full[sel] = rows
            rows = full
    if sel is None:
        sel = torch.arange(len(files))
    if errors and sel.numel() < len(files):  # report only the chosen files' errors
        chosen, pos = set(sel.tolist()), {f: i for i, f in enumerate(files)}
        errors = [e for e in errors if pos[e[0]] in chosen]
    if errors:
        if on_corrupt == "error":
            rel, msg = errors[0]
            raise DataError(f"cannot read image {root / rel} ({msg}); fix or remove it, or pass on_corrupt='skip'")
        shown = ", ".join(str(root / rel) for rel, _ in errors[:3])
        more = f" and {len(errors) - 3} more" if len(errors) > 3 else ""
        warnings.warn(f"skipped {len(errors)} unreadable image(s): {shown}{more}", stacklevel=3)
    if resized:
        h, w = images.shape[-2:]
        warnings.warn(f"{root}: resized {resized} image(s) to {h}x{w}, the size of the first image", stacklevel=3)
    r = rows[sel]
    keep = r >= 0
    if not bool(keep.any()):
        raise DataError(f"no readable images in {root}")
    if sel.numel() == len(files) and bool(keep.all()):
        # A cache hit is memory-mapped: copy, so the dataset does not depend on the cache file.
        out = images.clone() if cached is not None else images
    else:
        out = images[r[keep]].contiguous()
    lab = labels[sel][keep]
    mean, std = _channel_stats(out)
    return ImageTensorDataset(out, lab, classes, mean, std, f"{root.parent.name}/{root.name}")
