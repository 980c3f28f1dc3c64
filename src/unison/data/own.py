"""The user's own images: a `torch.utils.data.Dataset` (or `IterableDataset`) and, optionally, their own view transform.

`build_own_source(spec, device, augmentation, dataset, transform)` is the `TrainData` of ``unison.train(cfg,
dataset=..., transform=...)``, beside `unison.data.source.build_batch_source` for unison's own data layouts.

Items: a PIL image, a uint8 or float ([0, 1]) tensor or array ``[3, H, W]`` / ``[H, W, 3]`` (1 channel: grey), or
``(image, label, ...)`` (the label is not used: there is no held-out set, so no kNN and no online probe).
`as_image` is the one rule; `OwnImages.first_views` applies it (and the transform) to the first item before
any worker starts (`unison.training.own.check_pieces`) and each build applies it to every item it reads.

Views:

* without a transform, unison's augmentation of the method's recipe (`ViewAugmenter`), batched, exactly as for
  in-memory data: the items must have one size (the first item's);
* with a transform, ``transform(image)`` per sample on the raw item's image: it returns one view (a float tensor
  ``[3, h, w]``; called once per view the method takes) or a list of all of them. Around each call the global RNGs
  of ``random``, NumPy and torch (CPU) are seeded from (seed, epoch, sample index, view) and restored after
  (`seeded_rngs`), so a transform that draws from them (torchvision's, Albumentations', Lightly's) makes the same
  views whatever the world size, the rank or the number of loader processes.

Order: a map-style dataset is read in unison's global order (`EpochOrder`: a function of (seed, epoch)), each rank
reading only its slice of every global batch, in ``loader_workers`` processes (forked; 0: in the training process;
default: as for streamed data, the cores per worker less one);
an iterable one in its own order, every rank iterating it whole and keeping its slice (it must yield the same items
in every process), the sample index being the position in the epoch's pass.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from unison.distributed.collectives import local_slice
from unison.errors import ConfigError, DataError
from unison.rng import combine_key

from .augment import ViewAugmenter
from .batches import EpochOrder
from .source import STATS_IMAGES, TrainData, default_image_size
from .spec import DataSpec, check_batch
from .stream import default_loader_workers, job_loader
from .subsets import channel_stats

__all__ = ["ITEMS", "OwnBatches", "OwnImages", "as_image", "build_own_source", "seeded_rngs"]

ITEMS = ("a PIL image, a uint8 or float [0, 1] tensor/array [3, H, W] or [H, W, 3], or (image, label)")
_TRANSFORM_STREAM = 0x0A_7F_0001   # the RNG stream of user transforms (unison's augmentation uses small streams)


def raw_image(item: Any) -> Any:
    """The image of a dataset item (its first element when the item is a tuple or list)."""
    return item[0] if isinstance(item, (tuple, list)) and item else item


def as_image(item: Any, where: str) -> torch.Tensor:
    """uint8 ``[3, H, W]`` of a dataset item; `DataError` naming `where` (``item 0 of MyDataset``) if it is none."""
    image = raw_image(item)
    if type(image).__module__.startswith("PIL."):
        image = np.array(image.convert("RGB"))   # a writable copy (np.asarray's is read-only)
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image if image.flags.writeable else image.copy()))
    if not isinstance(image, torch.Tensor):
        raise DataError(f"{where} is {type(image).__name__}, not an image; a dataset item must be {ITEMS}")
    x = image.detach().cpu()
    if x.ndim == 2:
        x = x[None]
    if x.ndim == 3 and x.shape[0] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.permute(2, 0, 1)
    if x.ndim != 3 or x.shape[0] not in (1, 3) or min(x.shape[1:]) < 1:
        raise DataError(f"{where} has shape {tuple(image.shape)}, not an image; a dataset item must be {ITEMS}")
    if x.is_floating_point():
        if not bool(x.isfinite().all()) or float(x.min()) < 0 or float(x.max()) > 1:
            raise DataError(f"{where} is a float image with values outside [0, 1]; give float images in [0, 1] "
                            "or uint8 (0 to 255)")
        x = (x * 255).round().to(torch.uint8)
    elif x.dtype != torch.uint8:
        raise DataError(f"{where} is a {x.dtype} image; give uint8 (0 to 255) or float in [0, 1]")
    return x.expand(3, -1, -1).contiguous()


@contextlib.contextmanager
def seeded_rngs(seed: int, epoch: int, index: int, view: int) -> Iterator[None]:
    """The global RNGs of ``random``, NumPy and torch (CPU) seeded from (seed, epoch, index, view), restored after."""
    key = combine_key(seed, epoch, index, view, _TRANSFORM_STREAM)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(key)
    np.random.seed(key % 2**32)
    torch.default_generator.manual_seed(key)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class OwnImages:
    """The user's dataset (map-style or iterable) and transform: items, their views and uint8 images."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any] | None, num_views: int, seed: int):
        self.dataset, self.transform, self.num_views, self.seed = dataset, transform, num_views, seed
        self.name = type(dataset).__name__
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")
        try:
            self.length: int | None = len(dataset)
        except TypeError:
            self.length = None
        if not self.iterable and self.length is None:
            raise ConfigError(f"dataset {self.name} has __getitem__ but no __len__; give a torch.utils.data.Dataset "
                              "with both, or an IterableDataset")

    def first(self) -> Any:
        """Item 0 (the first the iterable yields)."""
        try:
            return next(iter(self.dataset)) if self.iterable else self.dataset[0]
        except StopIteration:
            raise DataError(f"dataset {self.name} is empty") from None

    def views(self, item: Any, index: int, epoch: int) -> list[torch.Tensor]:
        """The transform's views of one item (float ``[3, h, w]`` each), seeded by (seed, epoch, index, view)."""
        assert self.transform is not None
        image = raw_image(item)
        with seeded_rngs(self.seed, epoch, index, 0):
            out = self.transform(image)
        if isinstance(out, (list, tuple)):
            views = list(out)
        else:
            views = [out]
            for v in range(1, self.num_views):
                with seeded_rngs(self.seed, epoch, index, v):
                    views.append(self.transform(image))
        where = f"transform({self.name} item {index})"
        if len(views) != self.num_views:
            raise ConfigError(f"{where} returned {len(views)} views; the method takes {self.num_views}: return one "
                              f"view (a tensor) or a list of {self.num_views}")
        for v, x in enumerate(views):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim != 3 or x.shape[0] != 3:
                what = f"a {x.dtype} tensor {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ConfigError(f"{where} view {v} is {what}; a view must be a float tensor [3, H, W] "
                                  "(end the transform with ToTensor()/ToDtype(float32, scale=True) and Normalize)")
        return views

    def image(self, item: Any, index: int) -> torch.Tensor:
        return as_image(item, f"item {index} of {self.name}")

    def items(self, indices: Sequence[int]) -> list[Any]:
        """Items at `indices` (map-style only)."""
        return [self.dataset[int(i)] for i in indices]

    def uint8_at(self, indices: Sequence[int], size: int) -> torch.Tensor:
        """uint8 ``[N, 3, size, size]`` of the items at `indices`: shorter side resized to `size`, centre square."""
        return torch.stack([square(self.image(item, int(i)), size) for i, item in zip(indices, self.items(indices))])


def square(x: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 ``[3, H, W]`` -> ``[3, size, size]``: shorter side to `size` (antialiased), centre crop."""
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    if (nh, nw) != (h, w):
        y = F.interpolate(x[None].float(), size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)[0]
        x = y.round().clamp(0, 255).to(torch.uint8)
    top, left = (nh - size) // 2, (nw - size) // 2
    return x[:, top:top + size, left:left + size].contiguous()


class _MakeViews:
    """A job ``(epoch, [indices])`` -> its views: what a loader process (or the training process) runs."""

    def __init__(self, images: OwnImages, augment: ViewAugmenter):
        self.images, self.augment = images, augment
        self.size: tuple[int, int] | None = None   # the first item's (H, W): without a transform, every item's

    def __call__(self, job: tuple[int, list[int]]) -> dict[str, Any]:
        epoch, indices = job
        return self.of(epoch, indices, self.images.items(indices))

    def of(self, epoch: int, indices: list[int], items: list[Any]) -> dict[str, Any]:
        idx = torch.tensor(indices, dtype=torch.int64)
        if self.images.transform is not None:
            per_sample = [self.images.views(item, i, epoch) for i, item in zip(indices, items)]
            views = []
            for v in range(self.images.num_views):
                shapes = {tuple(s[v].shape) for s in per_sample}
                if len(shapes) > 1:
                    raise DataError(f"the transform's view {v} has shapes {sorted(shapes)} within one batch; every "
                                    "view must have one size (end with a crop or resize to a fixed size)")
                views.append(torch.stack([s[v].float() for s in per_sample]))
            return {"epoch": epoch, "indices": idx, "views": views}
        images = [self.images.image(item, i) for i, item in zip(indices, items)]
        self.size = self.size or (int(images[0].shape[-2]), int(images[0].shape[-1]))
        for i, x in zip(indices, images):
            if tuple(x.shape[-2:]) != self.size:
                raise DataError(f"item {i} of {self.images.name} is {x.shape[-1]}x{x.shape[-2]} px, item 0 "
                                f"{self.size[1]}x{self.size[0]}: unison's augmentation batches images of one size; "
                                "resize them in the dataset, or give transform=")
        return {"epoch": epoch, "indices": idx, "views": self.augment(torch.stack(images), idx, epoch, self.images.seed)}


class OwnBatches:
    """`BatchSource` over `OwnImages`: see the module docstring for the order and the views."""

    def __init__(self, images: OwnImages, augment: ViewAugmenter, global_batch: int, seed: int, *,
                 device: torch.device, loader_workers: int = 0, batches_per_epoch: int | None = None):
        self.images, self.global_batch, self.seed, self.device = images, global_batch, seed, device
        self.make = _MakeViews(images, augment)
        self.loader_workers = 0 if images.iterable else loader_workers
        if images.iterable:
            if images.length is not None:
                check_batch(f"dataset {images.name}", images.length, global_batch)
            if images.length is None and batches_per_epoch is None:
                raise ConfigError(f"dataset {images.name} is iterable without __len__, so an epoch's length is "
                                  "unknown; give max_steps (the run is then one epoch), or define __len__")
            self.batches_per_epoch = images.length // global_batch if images.length is not None else \
                int(batches_per_epoch or 1)
        else:
            self.order = EpochOrder(images.length or 0, global_batch, seed, f"dataset {images.name}")
            self.batches_per_epoch = self.order.batches_per_epoch

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        jobs = self._iterable(batch_number) if self.images.iterable else self._loader(batch_number)
        for out in jobs:
            views = [v.to(self.device, non_blocking=True) for v in out["views"]]
            yield int(out["epoch"]), out["indices"].to(self.device), views

    def _loader(self, batch_number: int) -> Iterator[dict[str, Any]]:
        if self.loader_workers == 0:   # in this process, without a DataLoader (which draws from torch's RNG)
            return (self.make((epoch, rows.tolist())) for epoch, rows in self.order.iter_from(batch_number))
        return iter(job_loader(self.make, self.order, batch_number, self.loader_workers, self.device))

    def _iterable(self, batch_number: int) -> Iterator[dict[str, Any]]:
        """Pass after pass over the iterable (epoch = pass): global batches of consecutive items, this rank's slice."""
        rows, b = local_slice(self.global_batch), self.global_batch
        epoch, skip = divmod(batch_number, self.batches_per_epoch) if self.images.length is not None else (0, batch_number)
        while True:
            position, batch, made = 0, [], 0
            for item in self.images.dataset:
                batch.append(item)
                position += 1
                if len(batch) < b:
                    continue
                if skip:
                    skip -= 1
                else:
                    first = position - b
                    keep = list(range(first, position))[rows]
                    yield self.make.of(epoch, keep, batch[rows])
                made, batch = made + 1, []
                if self.images.length is not None and made == self.batches_per_epoch:
                    break
            if made == 0:
                raise DataError(f"dataset {self.images.name} yielded {position} items in a pass, fewer than one "
                                f"global batch ({b}); lower --batch-size")
            epoch += 1


def build_own_source(spec: DataSpec, device: torch.device, augmentation: str, dataset: Any,
                     transform: Callable[[Any], Any] | None, *, max_batches: int | None = None,
                     val: Any = None) -> TrainData:
    """The `TrainData` of the user's `dataset` (and `transform`): views, image size, normalisation. `max_batches`:
    the global batches of the run, the epoch of an iterable dataset without ``__len__``. `val`: labelled held-out
    items, the kNN queries against `dataset`'s labelled items (`own_knn_sets`)."""
    probe = ViewAugmenter(augmentation, spec.image_size or 32, (0.5,) * 3, (0.5,) * 3, **spec.augment_overrides())
    images = OwnImages(dataset, transform, probe.num_views, spec.seed)
    first = images.first()
    image = images.image(first, 0)
    if transform is not None:
        size = int(images.views(first, 0, 0)[0].shape[-1])
        if spec.image_size is not None and spec.image_size != size:
            raise ConfigError(f"image_size={spec.image_size}, but the transform makes {size} px views; leave "
                              "image_size out (the transform decides it) or make the transform's views that size")
    else:
        size = spec.image_size or default_image_size(int(image.shape[-2]), int(image.shape[-1]),
                                                     f"dataset {images.name}")
    if images.iterable:   # the first items (an iterable has no others to pick)
        first_items = itertools.islice(iter(dataset), STATS_IMAGES)
        stats_images = torch.stack([square(images.image(x, i), size) for i, x in enumerate(first_items)])
    else:
        stats_images = images.uint8_at(_spaced(images.length or 0), size)
    mean, std = channel_stats(stats_images)
    augment = ViewAugmenter(augmentation, size, mean, std, **spec.augment_overrides())
    workers = spec.loader_workers if spec.loader_workers is not None else default_loader_workers(spec.world_size)
    source = OwnBatches(images, augment, spec.batch_size, spec.seed, device=device, loader_workers=workers,
                        batches_per_epoch=max_batches)
    n = images.length if images.length is not None else source.batches_per_epoch * spec.batch_size
    if val is not None:
        if images.iterable:
            raise ConfigError(f"val= needs a map-style dataset= of (image, label) items to score against; "
                              f"{images.name} is iterable")
        knn = own_knn_sets(dataset, val, size, device, spec.seed, spec.val_subset)
        return TrainData(source, augment, "own", size, mean, std, n, None, None, knn, None, own=images)
    return TrainData(source, augment, "own", size, mean, std, n, None, None, None,
                     f"the data is your own dataset ({images.name}), with no held-out set: give val= (labelled "
                     "held-out items) for a kNN", own=images)


def _spaced(n: int) -> list[int]:
    """`STATS_IMAGES` evenly spaced indices of `n` (the items the channel statistics are measured on)."""
    return [int(i) for i in np.linspace(0, n - 1, min(n, STATS_IMAGES)).round().astype(np.int64)]


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
                  for item in (images.dataset[i] for i in range(images.length or 0))]
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
    from .evalsets import KnnSets, knn_subsets

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
