"""Where a rank's training batches come from: a `BatchSource` yields ``(epoch, indices, views)``.

The global order is a function of (seed, epoch) alone: epoch e's global batches are
``global_batches(n, B, e, seed)`` on every rank, and rank r takes its contiguous share
(`local_slice`). A sample's views are a function of (seed, epoch, sample index) alone
(`unison.rng`), so what a sample looks like never depends on the world size,
the rank it lands on, or how many loader workers decode it.

`InMemoryBatches` is the source for data decoded once into one uint8 tensor on the
device (digits, CIFAR-scale folders): it indexes its rows and augments them on the
device. Streaming sources for data that does not fit (the real-scale data path) plug in
behind the same two members, so the training step never knows which one it reads.

Example::

    source = InMemoryBatches(train_set.to(device), augment, global_batch=256, seed=0)
    for epoch, indices, views in source.iter_from(batch_number=0):
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from unison.distributed.collectives import local_slice
from unison.rng import global_batches

from .augment import ViewAugmenter
from .datasets import ImageTensorDataset


class BatchSource(Protocol):
    """This rank's share of every global batch, in the global order of (seed, epoch)."""

    batches_per_epoch: int

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        """From global batch number `batch_number` (counted over epochs) on: ``(epoch, indices, views)``,
        where `indices` are this rank's sample indices and `views` their augmented views (float, normalised)."""
        ...


class InMemoryBatches:
    """`BatchSource` over an `ImageTensorDataset` held on the training device; augments on the device."""

    def __init__(self, data: ImageTensorDataset, augment: ViewAugmenter, global_batch: int, seed: int):
        if len(data) < global_batch:
            raise ValueError(f"{len(data)} images cannot fill one global batch of {global_batch}")
        self.data, self.augment, self.global_batch, self.seed = data, augment, global_batch, seed
        self.batches_per_epoch = len(data) // global_batch
        self.rows = local_slice(global_batch)

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        epoch, first = divmod(batch_number, self.batches_per_epoch)
        while True:
            order = global_batches(len(self.data), self.global_batch, epoch, self.seed)
            for batch in order[first:]:
                indices = batch[self.rows].to(self.data.images.device)
                yield epoch, indices, self.augment(self.data.images[indices], indices, epoch=epoch, seed=self.seed)
            epoch, first = epoch + 1, 0
