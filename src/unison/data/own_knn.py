"""The kNN and linear-probe sets of the user's own labelled datasets (``unison.train(..., dataset=, val=)``,
``unison.evaluate(run, dataset=, val=)``): the rule of `unison.data.evalsets` (class-balanced, at most 5,000
reference and 2,000 held-out items, chosen by the seed), the items read when embedded.

Labels: the dataset's ``targets`` (torchvision's ``ImageFolder``, ``CIFAR10``, ...), else the second element of each
item ``(image, label, ...)``, which reads every item once.

Example::

    sets = own_knn_sets(MyLabelled("train"), MyLabelled("val"), 32, torch.device("cpu"), seed=0)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unison.errors import ConfigError, DataError

from .evalsets import KnnSets, knn_subsets
from .own import OwnImages

__all__ = ["OwnLazyImages", "item_labels", "own_knn_sets"]


class OwnLazyImages:
    """Items of the user's map-style dataset read on demand at ``size`` (shorter side resized, centre square): the
    `unison.data.evalsets.LazyImages` interface (``shape``, slices, ``decode(a, b)``) for `unison.eval.knn`."""

    def __init__(self, images: OwnImages, indices: np.ndarray, size: int, device: torch.device):
        self.images, self.indices, self.size, self.device = images, indices, size, device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.indices), 3, self.size, self.size)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> OwnLazyImages:
        return OwnLazyImages(self.images, self.indices[part], self.size, self.device)

    def decode(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images.uint8_at([int(i) for i in self.indices[start:stop]], self.size).to(self.device)
        return x, torch.ones(len(x), dtype=torch.bool, device=self.device)


def item_labels(images: OwnImages) -> torch.Tensor:
    """The class label of every item of a map-style dataset: its ``targets`` (torchvision's datasets), else the
    second element of each item (every item is read once). `DataError` where an item has no int label."""
    targets = getattr(images.dataset, "targets", None)
    if targets is not None and len(targets) == images.length:
        values = list(targets)
    else:
        values = [item[1] if isinstance(item, (tuple, list)) and len(item) > 1 else None
                  for item in (images.item(i) for i in range(images.length or 0))]
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise DataError(f"item {i} of {images.name} has no class label ({type(v).__name__}); kNN and the linear "
                            "probe need items (image, label) with an int label >= 0, or a .targets list")
        values[i] = int(v)
    return torch.tensor(values, dtype=torch.int64)


def own_knn_sets(reference: Any, queries: Any, size: int, device: torch.device, seed: int,
                 val_subset: int | None = None) -> Any:
    """`unison.data.evalsets.KnnSets` of the user's labelled datasets: a class-balanced choice of at most 5,000
    `reference` and 2,000 (or `val_subset`) `queries` items, read when embedded (the rule of `knn_subsets`)."""
    sets = []
    for what, dataset in (("dataset=", reference), ("val=", queries)):
        images = OwnImages(dataset, None, 1, seed)
        if images.iterable:
            raise ConfigError(f"{what} {images.name} is iterable; kNN and the linear probe need a map-style dataset "
                              "(__len__ and __getitem__) of (image, label) items")
        if not images.length:
            raise DataError(f"{what} {images.name} is empty")
        sets.append((images, item_labels(images)))
    (ref_images, ref_labels), (query_images, query_labels) = sets
    ref, query = knn_subsets(ref_labels, query_labels, val_subset, seed)
    classes = int(max(ref_labels.max(), query_labels.max())) + 1
    return KnnSets(OwnLazyImages(ref_images, ref.numpy(), size, device), ref_labels[ref].to(device),
                   OwnLazyImages(query_images, query.numpy(), size, device), query_labels[query].to(device), classes)
