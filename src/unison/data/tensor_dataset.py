"""`ImageTensorDataset`: a whole image set decoded into one uint8 tensor, the value every in-memory path shares.

It lives alone at the bottom of the data package so that the built-in sets (`unison.data.builtin`),
decoded catalogs (`unison.data.memory`), synthetic images (`unison.data.synthetic`) and the batch
sources can all build or read it without importing the dispatcher `unison.data.datasets.load_dataset`.

Example::

    ds = ImageTensorDataset(images, labels, ["cat", "dog"], mean, std, "pets")   # uint8 [N, 3, H, W], int64 [N]
    ds = ds.to("cuda")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ImageTensorDataset"]


@dataclass
class ImageTensorDataset:
    """uint8 images ``[N, 3, H, W]`` with int64 labels ``[N]`` (-1: none), class names and channel statistics."""

    images: torch.Tensor  # uint8 [N, 3, H, W], contiguous
    labels: torch.Tensor  # int64 [N]; -1 = no label
    classes: list[str]    # [] for unlabelled data
    mean: tuple[float, float, float]  # per channel, [0, 1] units
    std: tuple[float, float, float]
    name: str
    # decoded from a catalog without resizing (`unison.data.memory.load_catalog`): the row of each catalog image in
    # `images` (-1: not held); the kNN reference set of the same catalog is then taken from here, not decoded again
    # (`unison.data.evalsets.held_rows`)
    catalog_rows: torch.Tensor | None = None
    # images of the catalog that could not be read and were left out (``on_corrupt="skip"``): name -> why
    unreadable: dict[str, str] = dataclasses.field(default_factory=dict)

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

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

    def to(self, device: torch.device | str) -> ImageTensorDataset:
        return dataclasses.replace(self, images=self.images.to(device), labels=self.labels.to(device))
