"""The built-in data sets: the embedded digits and CIFAR-10 through torchvision.

``"digits"``   scikit-learn's 1797 8x8 digits (bundled, no download): 0..16 scaled to
               0..255, bilinearly upsampled to 16x16, replicated to RGB. A fixed
               stratified 80/20 split: ``split="train"`` (1438) / ``"val"`` (359),
               the same for every seed. mean / std from the train split (both splits share them).
``"cifar10"``  torchvision's CIFAR-10 in ``root`` (default ``<cache>/cifar10``), downloaded if
               needed; ``"train"`` = official train set, ``"val"``/``"test"`` = official test set;
               the standard mean / std constants.

Example::

    train = load_digits("train")        # ImageTensorDataset, uint8 [1438, 3, 16, 16]
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from unison.errors import DataError
from unison.rng import combine_key, hash64

from .subsets import channel_stats
from .tensor_dataset import ImageTensorDataset

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "digits_all", "load_cifar10", "load_digits"]

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # official train set, per pixel
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_SPLIT_SEED = 0x5D1617  # fixed: the digits split never depends on `seed`


def load_digits(split: str) -> ImageTensorDataset:
    if split not in ("train", "val"):
        raise DataError(f"digits has splits 'train' and 'val', got {split!r}")
    images, labels = digits_all()
    is_val = _stratified_val_mask(labels, 0.2)
    mean, std = channel_stats(images[~is_val])
    keep = is_val if split == "val" else ~is_val
    return ImageTensorDataset(
        images[keep].contiguous(), labels[keep], [str(c) for c in range(10)], mean, std, f"digits-{split}"
    )


def digits_all() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as uint8 [N, 3, 16, 16] and int64 labels."""
    pixels, labels = _digits_file()
    x = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) * (255 / 16)  # [N, 1, 8, 8], 0..255
    # Bilinear (not nearest): smooth strokes survive random crops/rotations better than 2x2 blocks.
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    images = x.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    return images, torch.tensor(labels, dtype=torch.int64)


@functools.lru_cache(maxsize=1)
def _digits_file() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's copy of the UCI digits (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the label per
    row), read as its ``load_digits`` reads it but without importing scikit-learn: that import takes seconds, in
    every worker of every run on the embedded default (the train and the val split share this one read)."""
    spec = importlib.util.find_spec("sklearn")   # finds the package without importing it
    path = (Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not path.is_file():   # another layout: scikit-learn's own reader
        from sklearn.datasets import load_digits as sklearn_digits

        d = sklearn_digits()
        return d.data.astype(np.float64), d.target.astype(np.int64)
    data = np.loadtxt(path, delimiter=",")
    data.setflags(write=False)   # cached: shared by every caller
    return data[:, :-1], data[:, -1].astype(np.int64)


def _stratified_val_mask(labels: torch.Tensor, frac: float) -> torch.Tensor:
    """round(frac * n_c) random samples of every class c, fixed by _SPLIT_SEED."""
    keys = hash64(combine_key(_SPLIT_SEED), torch.arange(labels.shape[0]), 1)[:, 0]
    mask = torch.zeros(labels.shape[0], dtype=torch.bool)
    for c in labels.unique().tolist():  # 10 classes: a loop over classes, not samples
        members = (labels == c).nonzero()[:, 0]
        chosen = members[torch.argsort(keys[members], stable=True)[: round(frac * members.numel())]]
        mask[chosen] = True
    return mask


def load_cifar10(split: str, root: str | None, cache_dir: Path) -> ImageTensorDataset:
    if split not in ("train", "val", "test"):
        raise DataError(f"cifar10 has splits 'train' and 'val' (= the official test set), got {split!r}")
    from torchvision.datasets import CIFAR10

    path = Path(root).expanduser() if root else cache_dir / "cifar10"
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
