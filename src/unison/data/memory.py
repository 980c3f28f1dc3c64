"""Decode a whole catalog (folder, file list or shards) into one uint8 tensor, with an on-disk cache.

The in-memory path for data that fits (CIFAR-scale): every image decoded once into
``images`` uint8 ``[N, 3, H, W]``, which training moves to the device and augments there.

* Decoding uses PIL for every format (as the streamed and kNN paths do), in a thread pool; images
  are converted to RGB and shown upright (EXIF orientation applied, as `PIL.ImageOps.exif_transpose`).
  torchvision's decoders are not used: its PNG decoder can crash the process (SIGSEGV) on a corrupt
  PNG after printing ``libpng error:`` lines, and libjpeg's warnings go straight to stderr.
* All images must share one size: images of another size are resized (bilinear,
  antialiased) to one (a training run's: `unison.data.source.stored_size`, the sampled image of median shorter
  side; else the first image's in sample order), with one warning.
  Data of many sizes belongs on the streaming path (``--data-mode stream``, what ``auto`` picks for it).
* Unreadable images: ``on_corrupt="skip"`` drops them with one warning (count and
  first paths); ``on_corrupt="error"`` raises `DataError` naming the file.
* Full loads are cached as a tensor file under ``$UNISON_CACHE_DIR`` (default
  ``~/.cache/unison``), keyed by the location and every file's name, size and mtime,
  so changed data is decoded again. ``UNISON_NO_CACHE=1`` disables it. The cache is
  never written inside the data folder.
* ``subset=n`` picks n files class-balanced (`balanced_subset`), determined by ``seed``
  and the file list only; a subset load decodes only the chosen files.
* mean / std: per-channel statistics of the returned images (`channel_stats`).

Example::

    ds = load_catalog(open_catalog("../shared/data/cifar10/train"), subset=5000, on_corrupt="skip", seed=0)
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from unison.distributed.collectives import rank
from unison.errors import DataError
from unison.paths import cache_root
from unison.progress import Progress

from .files import decode_reason, open_image, orientation, upright, upright_size
from .samples import Catalog
from .subsets import balanced_subset, channel_stats
from .tensor_dataset import ImageTensorDataset

__all__ = ["decode_all", "decode_bytes", "free_device_memory", "load_catalog", "physical_memory"]

_CACHE_VERSION = 2   # 2: EXIF orientation applied, PIL decodes every format


def load_catalog(catalog: Catalog, subset: int | None, on_corrupt: str, seed: int,
                 size: tuple[int, int] | None = None, warn_unreadable: bool = True) -> ImageTensorDataset:
    """Every image of `catalog` (or a class-balanced `subset`) decoded into memory; see the module docstring.
    `size`: the (H, W) every image is held at (`unison.data.source.stored_size`, a training run's); None: the
    first readable image's. The unreadable images left out are in the dataset's ``unreadable``; `warn_unreadable`
    False: no warning of them here (a training run reports them itself, once over its workers)."""
    labels = torch.from_numpy(catalog.labels)
    n = len(catalog)
    stats = catalog.file_stats()
    cache_path = _cache_file(catalog, stats)
    sel = balanced_subset(labels, subset, seed) if subset is not None else None
    cached = _read_cache(cache_path)
    if cached is not None and size is not None and tuple(cached["images"].shape[-2:]) != tuple(size):
        cached = None   # held at another size (images of several sizes, decoded before at the first one's)
    if cached is not None:
        images, rows, errors, resized = cached["images"], cached["rows"], cached["errors"], cached["resized"]
    else:
        size = size or _reference_size(catalog)
        todo = list(range(n)) if sel is None else sel.tolist()
        images, rows, errors, resized = decode_all(catalog, todo, size)
        if sel is None:
            _write_cache(cache_path, dict(images=images, rows=rows, errors=errors, resized=resized))
        else:  # rows are relative to the subset: express them over all files
            full = torch.full((n,), -1, dtype=torch.int64)
            full[sel] = rows
            rows = full
    if sel is None:
        sel = torch.arange(n)
    if errors and sel.numel() < n:  # report only the chosen files' errors
        chosen = set(sel.tolist())
        errors = [e for e in errors if e[0] in chosen]
    if errors:
        if on_corrupt == "error":
            i, msg = errors[0]
            raise DataError(f"cannot read image {catalog.describe(i)} ({msg}); fix or remove it, or pass "
                            "on_corrupt='skip'")
        shown = ", ".join(catalog.describe(i) for i, _ in errors[:3])
        more = f" and {len(errors) - 3} more" if len(errors) > 3 else ""
        if warn_unreadable and rank() == 0:   # every worker decodes the same images: one warning, not one each
            warnings.warn(f"skipped {len(errors)} unreadable image(s): {shown}{more}", stacklevel=3)
    if resized and rank() == 0:
        h, w = images.shape[-2:]
        warnings.warn(f"{catalog.location}: resized {resized} image(s) to {h}x{w}, the size the images are held at "
                      "in memory (--data-mode stream keeps each its own)", stacklevel=3)
    r = rows[sel]
    keep = r >= 0
    if not bool(keep.any()):
        raise DataError(f"no readable images in {catalog.location}")
    if sel.numel() == n and bool(keep.all()):
        # A cache hit is memory-mapped: copy, so the dataset does not depend on the cache file.
        out = images.clone() if cached is not None else images
    else:
        out = images[r[keep]].contiguous()
    mean, std = channel_stats(out)
    held = None
    if not resized:   # each row is the image as decoded, which is what the kNN sets decode at this size
        held = torch.full((n,), -1, dtype=torch.int64)
        held[sel[keep]] = torch.arange(out.shape[0])
    return ImageTensorDataset(out, labels[sel][keep], list(catalog.classes), mean, std, catalog.display_name, held,
                              unreadable={catalog.describe(i): msg for i, msg in errors})


def physical_memory() -> int | None:
    """This machine's RAM in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):   # not a POSIX system that says
        return None


def free_device_memory(device: torch.device) -> int | None:
    """The free bytes of GPU `device` (CUDA's own count), or None for the CPU, whose images stay in the RAM."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def decode_bytes(data: bytes) -> torch.Tensor:
    """uint8 [3, H, W] RGB, shown upright (EXIF orientation); raises on unreadable data and past `MAX_PIXELS`
    (checked on the header first). PIL releases the GIL while it decodes: the thread pool runs in parallel."""
    import numpy as np

    from .decode import to_rgb

    with open_image(data) as im:
        rgb = np.array(upright(to_rgb(im), orientation(im)))   # inside: to_rgb returns an RGB image itself
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


def decode_all(catalog: Catalog, todo: list[int], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, list, int]:
    """Decode samples `todo` into uint8 [n_ok, 3, H, W]; returns (images, row per sample or -1, errors, n_resized).

    errors: sorted (sample index, message) of the unreadable ones.
    """
    n = len(todo)
    out = torch.empty((n, 3, *size), dtype=torch.uint8)
    ok = torch.zeros(n, dtype=torch.bool)

    def work(lo: int, hi: int) -> tuple[list[tuple[int, str]], int]:
        errors, resized = [], 0
        for k in range(lo, hi):
            try:
                img = decode_bytes(catalog.read(todo[k]))
            except Exception as e:
                errors.append((todo[k], decode_reason(e)))
                continue
            if tuple(img.shape[1:]) != size:
                x = F.interpolate(img[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)
                img = x[0].round().clamp(0, 255).to(torch.uint8)
                resized += 1
            out[k] = img  # disjoint rows per task: no lock needed
            ok[k] = True
        return errors, resized

    chunk = 256  # per-task overhead matters for tiny JPEGs
    progress = Progress(f"decoding {catalog.display_name} into memory:", n, show=rank() == 0)   # once: then cached
    results = []
    with warnings.catch_warnings(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        warnings.simplefilter("ignore", UserWarning)   # PIL's per-file notes (corrupt EXIF, ...): counted as errors
        for lo, result in zip(range(0, n, chunk), pool.map(lambda lo: work(lo, min(lo + chunk, n)), range(0, n, chunk))):
            results.append(result)
            progress(min(lo + chunk, n))
    errors = sorted(e for errs, _ in results for e in errs)
    resized = sum(r for _, r in results)
    rows = torch.full((n,), -1, dtype=torch.int64)
    rows[ok] = torch.arange(int(ok.sum()))
    images = out if bool(ok.all()) else out[ok].contiguous()
    return images, rows, errors, resized


def _reference_size(catalog: Catalog) -> tuple[int, int]:
    """(H, W) of the first sample whose header reads, in sample order (subset-independent)."""
    for i in range(len(catalog)):
        try:
            with open_image(catalog.read(i)) as im:
                w, h = upright_size(im)
            return h, w
        except Exception:
            continue
    raise DataError(f"no readable images in {catalog.location} (every file failed to open)")


def _cache_file(catalog: Catalog, stats: list) -> Path | None:
    cache = cache_root(catalog.base)  # None: caching is off, or the cache would be inside the data folder
    if cache is None:
        return None
    root = catalog.location
    if catalog.kind == "folder":  # the key of unison <= 0.1's folder cache: existing caches stay valid
        key = [_CACHE_VERSION, str(root), catalog.names.tolist(), stats]
    else:
        key = [_CACHE_VERSION, catalog.kind, str(root), catalog.shards, catalog.names.tolist(), stats]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
    return cache / "images" / f"{root.parent.name}-{root.name}-{digest}.pt"


def _read_cache(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True, mmap=True)
        if set(data) != {"images", "rows", "errors", "resized"}:
            return None
        data["errors"] = [(int(i), str(m)) for i, m in data["errors"]]
        return data
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
