"""A user's own pieces that break their contracts, for ``unison.train(cfg, backbone=..., dataset=...)``: module-level,
so that worker processes can unpickle them."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from helpers.own_pieces import Photos, TinyNet


class RaisesAt(Photos):
    """`Photos` whose items raise, as a user's decoding bug does: item `bad` (``where="item"``), every item read in a
    DataLoader worker process (``"loader"``) or on rank 1 (``"rank1"``)."""

    def __init__(self, n: int = 32, bad: int = 5, where: str = "item") -> None:
        super().__init__(n)
        self.bad, self.where = bad, where

    def __getitem__(self, i: int):
        if {"item": i == self.bad, "loader": torch.utils.data.get_worker_info() is not None,
                "rank1": os.environ.get("RANK") == "1"}[self.where]:
            raise ValueError(f"cannot decode photo {i}")
        return super().__getitem__(i)


class Length(Photos):
    """`Photos` whose ``__len__`` says `length`."""

    def __init__(self, length: int) -> None:
        super().__init__(32)
        self.length = length

    def __len__(self) -> int:
        return self.length


class LengthPerRank(Photos):
    """`Photos` of 32 items on rank 0 and 48 on the others (a dataset listing files that differ between hosts)."""

    def __init__(self) -> None:
        super().__init__(48)

    def __len__(self) -> int:
        return 32 if int(os.environ.get("RANK", "0")) == 0 else 48


class ShortOnRank1(torch.utils.data.IterableDataset):
    """An iterable of the `Photos` images: 32 on rank 0, 16 on rank 1 (a shard missing on one host)."""

    def __init__(self) -> None:
        self.photos = Photos(32)

    def __iter__(self):
        n = 16 if int(os.environ.get("RANK", "0")) == 1 else 32
        yield from self.photos.images[:n]


class WiderInTraining(nn.Module):
    """`TinyNet` with 4 more features in training mode than in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return torch.cat([y, y[:, :4]], 1) if self.training else y


class NaNOut(TinyNet):
    """`TinyNet` whose features are NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float("nan")


class StreamRaises(torch.utils.data.IterableDataset):
    """An iterable of `Photos` images whose pass raises after 3 items (a shard that went away)."""

    def __iter__(self):
        yield from Photos(3).images
        raise OSError("shard-0003.tar is gone")
