"""A user's own pieces for ``unison.train(cfg, backbone=..., feature_dim=..., dataset=..., transform=...)``: a small
backbone with batch norm, a map-style and an iterable dataset of 12 px images, and a transform that draws from the
global RNGs of torch, ``random`` and NumPy. Module-level, so that worker processes can unpickle them."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn

WIDTH = 8


class TinyNet(nn.Module):
    """conv -> batch norm -> ReLU -> global average pool: [B, 3, H, W] -> [B, WIDTH]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, 3, padding=1)
        self.bn = nn.BatchNorm2d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


class Photos(torch.utils.data.Dataset):
    """`n` random uint8 images [3, 12, 12] with a label, a pure function of `seed`."""

    def __init__(self, n: int = 32, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, 12, 12), generator=g, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], i % 3


class PhotoStream(torch.utils.data.IterableDataset):
    """The same images as `Photos`, as an iterable dataset (HWC float in [0, 1], no labels)."""

    def __init__(self, n: int = 32) -> None:
        self.photos = Photos(n)

    def __len__(self) -> int:
        return len(self.photos)

    def __iter__(self):
        for image in self.photos.images:
            yield image.permute(1, 2, 0).float() / 255


def jitter(image: torch.Tensor) -> torch.Tensor:
    """One random 10 px view (crop, flip, noise), from the global RNGs of torch, random and NumPy."""
    x = image.float() / 255
    top, left = random.randint(0, 2), int(np.random.randint(0, 3))
    x = x[:, top:top + 10, left:left + 10]
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    return (x + 0.05 * torch.randn_like(x) - 0.5) / 0.25


def uneven_views(image: torch.Tensor) -> torch.Tensor:
    """A transform whose views are 10 px for about a third of the samples and 8 px for the rest: a batch of them
    cannot be stacked (the error is found in a loader process)."""
    x = image.float() / 255
    return x[:, :10, :10] if torch.rand(()) < 0.3 else x[:, :8, :8]
