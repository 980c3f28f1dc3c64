"""In-memory image datasets: every image decoded once into one uint8 tensor.

`load_dataset(spec, split)` returns an `ImageTensorDataset` whose ``images`` are
uint8 ``[N, 3, H, W]`` (contiguous) and ``labels`` int64 ``[N]`` (-1 where the data has
no labels; then ``classes == []``). Training moves it to the accelerator once
(``ds.to("cuda")``) and augments batches there (`unison.data.augment`), with no
DataLoader: for CIFAR-scale data this is the fastest known pattern and keeps
augmentation independent of worker counts. Data too large for this is streamed
instead (`unison.data.stream`); `unison.data.source` chooses.

Where the pieces live:

* ``"digits"`` and ``"cifar10"``: `unison.data.builtin`;
* folders, file lists and tar shards: `unison.data.catalog` (layouts) and
  `unison.data.memory` (decoding into memory, the cache);
* class-balanced subsets and channel statistics: `unison.data.subsets`;
* the `ImageTensorDataset` value itself: `unison.data.tensor_dataset` (re-exported here).

``split`` ("train" / "val") applies to the built-in sets; for the other layouts it is
ignored: pass the train and the val data separately.

Example::

    train = load_dataset("../shared/data/cifar10/train", subset=5000).to("cuda")
    val = load_dataset("../shared/data/cifar10/val").to("cuda")
    x = train.images[idx]                       # uint8 [B, 3, 32, 32] on the GPU
"""

from __future__ import annotations

import dataclasses

from unison.errors import DataError
from unison.paths import cache_dir

from .builtin import CIFAR10_MEAN, CIFAR10_STD, load_cifar10, load_digits
from .catalog import IMG_EXTENSIONS, open_catalog, scan_folder
from .memory import load_catalog
from .spec import BUILTIN
from .subsets import balanced_subset
from .tensor_dataset import ImageTensorDataset

__all__ = ["BUILTIN", "CIFAR10_MEAN", "CIFAR10_STD", "DataError", "IMG_EXTENSIONS", "ImageTensorDataset",
           "balanced_subset", "load_dataset", "scan_folder"]


def load_dataset(
    spec: str,
    split: str = "train",
    *,
    subset: int | None = None,
    on_corrupt: str = "skip",
    root: str | None = None,
    seed: int = 0,
) -> ImageTensorDataset:
    """Load ``"digits"``, ``"cifar10"``, a folder, a file list or tar shards into memory.

    split: ``"train"`` or ``"val"`` for digits/cifar10; ignored otherwise. subset: n class-balanced
    images chosen by ``seed``. on_corrupt: ``"skip"`` (warn once) or ``"error"``. root: download folder
    for ``"cifar10"`` only. Raises `DataError` with a one-line message saying what to fix.
    """
    if on_corrupt not in ("skip", "error"):
        raise DataError(f"on_corrupt must be 'skip' or 'error', got {on_corrupt!r}")
    if subset is not None and subset <= 0:
        raise DataError(f"subset must be a positive number of images, got {subset}")
    if spec == "digits":
        ds = load_digits(split)
    elif spec == "cifar10":
        ds = load_cifar10(split, root, cache_dir())
    else:
        return load_catalog(open_catalog(spec), subset, on_corrupt, seed)
    if subset is not None:
        keep = balanced_subset(ds.labels, subset, seed)
        ds = dataclasses.replace(ds, images=ds.images[keep].contiguous(), labels=ds.labels[keep])
    return ds
