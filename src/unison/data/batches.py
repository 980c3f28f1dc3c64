"""Where a rank's training batches come from: a `BatchSource` yields ``(epoch, indices, views)``.

The global order is a function of (seed, epoch) alone: epoch e's global batches are
``global_batches(n, B, e, seed)`` on every rank, and rank r takes its contiguous share
(`local_slice`). A sample's views are a function of (seed, epoch, sample index) alone
(`unison.rng`), so what a sample looks like never depends on the world size,
the rank it lands on, or how many loader workers decode it.

`EpochOrder` is that order, written once: the global batches of every epoch from any global
batch number on, this rank's share of each, and the rule that one global batch must fit the
data (`unison.data.spec.check_batch`). Every batch source is built on it.

`InMemoryBatches` is the source for data decoded once into one uint8 tensor on the
device (digits, CIFAR-scale folders): it indexes its rows and augments them on the
device. Streaming sources for data that does not fit (the real-scale data path) plug in
behind the same members, so the training step never knows which one it reads. A third member,
``crop_geometry(epoch, indices)``, says where each view of a yielded batch lies in its image (what VICRegL matches
feature-map cells by): the sources know the sizes of the images the views were cut from.

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
from .spec import check_batch
from .tensor_dataset import ImageTensorDataset

__all__ = ["BatchSource", "EpochOrder", "InMemoryBatches", "to_device_async"]


class BatchSource(Protocol):
    """This rank's share of every global batch, in the global order of (seed, epoch)."""

    batches_per_epoch: int

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        """From global batch number `batch_number` (counted over epochs) on: ``(epoch, indices, views)``,
        where `indices` are this rank's sample indices and `views` their augmented views (float, normalised)."""
        ...

    def crop_geometry(self, epoch: int, indices: torch.Tensor) -> torch.Tensor:
        """Where each view of the samples `indices` (of a batch `iter_from` has yielded in `epoch`) lies in its
        image: `ViewAugmenter.view_geometry`, float64 [B, V, 2, 3]. Raises `ConfigError` for views made
        elsewhere (your own transform), whose crops unison does not know."""
        ...


class EpochOrder:
    """The global batches of `n` samples (drop-last), epoch after epoch, and this rank's share of each.

    Raises `DataError` naming `what` when `n` samples cannot fill one global batch.
    """

    def __init__(self, n: int, global_batch: int, seed: int, what: str):
        check_batch(what, n, global_batch)
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.batches_per_epoch = n // global_batch
        self.rows = local_slice(global_batch)

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(epoch, this rank's sample indices)`` of every global batch from `batch_number` (counted over epochs)."""
        for epoch, rows in self.epochs_from(batch_number):
            for indices in rows:
                yield epoch, indices

    def epochs_from(self, batch_number: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """``(epoch, this rank's sample indices of each of its remaining global batches)`` per epoch from
        `batch_number`: the walk `iter_from` flattens, a whole epoch at a time."""
        epoch, first = divmod(batch_number, self.batches_per_epoch)
        while True:
            yield epoch, [batch[self.rows] for batch in global_batches(self.n, self.global_batch, epoch, self.seed)[first:]]
            epoch, first = epoch + 1, 0


class InMemoryBatches:
    """`BatchSource` over an `ImageTensorDataset` held on the training device; augments on the device."""

    def __init__(self, data: ImageTensorDataset, augment: ViewAugmenter, global_batch: int, seed: int):
        self.order = EpochOrder(len(data), global_batch, seed, "the training set")
        self.data, self.augment, self.global_batch, self.seed = data, augment, global_batch, seed
        self.batches_per_epoch = self.order.batches_per_epoch

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        for epoch, rows in self.order.epochs_from(batch_number):
            for indices in to_device_async(torch.stack(rows), self.data.images.device):
                yield epoch, indices, self.augment(self.data.images[indices], indices, epoch=epoch, seed=self.seed)

    def crop_geometry(self, epoch: int, indices: torch.Tensor) -> torch.Tensor:
        sizes = torch.tensor(self.data.images.shape[-2:], device=indices.device).expand(len(indices), 2)
        return self.augment.view_geometry(indices, epoch, self.seed, sizes)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, without making the host wait. A copy from pageable memory waits for every kernel queued
    before it: one per step keeps the host from running ahead of the GPU (the step then waits on the data path),
    and one per epoch still empties the GPU's queue at every epoch's start. From pinned memory the copy is queued
    like a kernel; torch's pinned-memory cache keeps the buffer until the copy has run."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
