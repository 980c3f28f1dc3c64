"""Random uint8 images as an in-memory dataset: what `unison check` and the benchmarks train on.

A pure function of (n, image size, seed), identical on every rank and in every process, so
a check or a benchmark needs no files and every rank of a run sees the same dataset (and,
through the global batch order, different samples).

Example::

    data = synthetic_dataset(64, image_size=16, seed=0)   # ImageTensorDataset, 64 x 3 x 16 x 16, one class
"""

from __future__ import annotations

import torch

from .tensor_dataset import ImageTensorDataset


def synthetic_dataset(n: int, image_size: int, seed: int = 0) -> ImageTensorDataset:
    """`n` random uint8 RGB images of `image_size` px, label 0, normalised with mean 0.5 and std 0.25."""
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    images = torch.randint(0, 256, (n, 3, image_size, image_size), generator=g, dtype=torch.uint8)
    return ImageTensorDataset(images, torch.zeros(n, dtype=torch.int64), ["none"], (0.5, 0.5, 0.5),
                              (0.25, 0.25, 0.25), "synthetic")
