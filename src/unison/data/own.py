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

from unison.distributed.collectives import all_gather_object, gather_no_grad, local_slice
from unison.distributed.watchdog import reading
from unison.errors import ConfigError, DataError
from unison.rng import combine_key

from .augment import ViewAugmenter
from .batches import EpochOrder
from .source import STATS_IMAGES, TrainData, default_image_size
from .spec import DataSpec, check_batch
from .stream import default_loader_workers, job_loader, raise_failed
from .subsets import channel_stats
from .user_code import user_raised

__all__ = ["ITEMS", "OwnBatches", "OwnImages", "as_image", "build_own_source", "seeded_rngs", "user_raised"]

ITEMS = ("a PIL image, a uint8 or float [0, 1] tensor/array [3, H, W] or [H, W, 3], or (image, label)")
MAX_ITEMS = 2**32   # a map-style dataset's length: its epoch order is a permutation of every index (8 bytes each)
_END = object()   # the end of an iterable dataset's pass
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
    """The user's dataset (map-style or iterable) and transform: items, their views and uint8 images.

    Every call into the user's code goes through `item`, `iterate` and `views`: an exception there is one
    `DataError` naming the item and the user's frame (`user_raised`); ``__len__`` is checked (an int from 0 to
    `MAX_ITEMS`)."""

    def __init__(self, dataset: Any, transform: Callable[[Any], Any] | None, num_views: int, seed: int):
        self.dataset, self.transform, self.num_views, self.seed = dataset, transform, num_views, seed
        self.name = type(dataset).__name__
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")
        self.length = self._length()
        if not self.iterable and self.length is None:
            raise ConfigError(f"dataset {self.name} has __getitem__ but no __len__; give a torch.utils.data.Dataset "
                              "with both, or an IterableDataset")

    def _length(self) -> int | None:
        """``len(dataset)``, checked; None without ``__len__`` (an iterable's may be absent or raise TypeError)."""
        if not hasattr(type(self.dataset), "__len__"):
            return None
        try:
            n = type(self.dataset).__len__(self.dataset)
        except TypeError as e:
            if self.iterable:
                return None   # torch's IterableDataset without a length of its own
            raise user_raised(f"your dataset {self.name}'s __len__ raised", e) from None
        except Exception as e:
            raise user_raised(f"your dataset {self.name}'s __len__ raised", e) from None
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_ITEMS:
            raise ConfigError(f"dataset {self.name}'s __len__ returned {str(n)[:40]}; it must return the number of "
                              f"items, an int from 0 to {MAX_ITEMS:,}")
        return int(n)

    def item(self, index: int) -> Any:
        """Item `index` of a map-style dataset (the user's ``__getitem__``), under the run's watchdog (`reading`)."""
        try:
            with reading():
                return self.dataset[index]
        except Exception as e:
            last = (f" (its last by __len__, which says {self.length:,} items)" if isinstance(e, (IndexError, KeyError))
                    and self.length is not None and index == self.length - 1 else "")
            raise user_raised(f"your dataset {self.name} raised at item {index}{last}", e) from None

    def iterate(self) -> Iterator[Any]:
        """One pass over an iterable dataset (the user's ``__iter__``)."""
        yielded = 0
        try:
            items = iter(self.dataset)
            while True:
                with reading():   # each item under the run's watchdog, as `item`'s
                    item = next(items, _END)
                if item is _END:
                    return
                yield item
                yielded += 1
        except Exception as e:
            raise user_raised(f"your dataset {self.name} raised at item {yielded} of its pass", e) from None

    def first(self) -> Any:
        """Item 0 (the first the iterable yields), and for a map-style dataset its last item too: a ``__len__`` that
        says more items than there are fails here, before any worker starts."""
        if not self.iterable:
            if self.length == 0:
                raise DataError(f"dataset {self.name} is empty")
            self.item((self.length or 1) - 1)
            return self.item(0)
        for item in self.iterate():
            return item
        raise DataError(f"dataset {self.name} is empty")

    def views(self, item: Any, index: int, epoch: int) -> list[torch.Tensor]:
        """The transform's views of one item (float ``[3, h, w]`` each), seeded by (seed, epoch, index, view)."""
        assert self.transform is not None
        image = raw_image(item)
        with seeded_rngs(self.seed, epoch, index, 0):
            out = self._transform(image, index, 0)
        if isinstance(out, (list, tuple)):
            views = list(out)
        else:
            views = [out]
            for v in range(1, self.num_views):
                with seeded_rngs(self.seed, epoch, index, v):
                    views.append(self._transform(image, index, v))
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

    def _transform(self, image: Any, index: int, view: int) -> Any:
        assert self.transform is not None
        try:
            return self.transform(image)
        except Exception as e:
            raise user_raised(f"your transform raised on item {index} of {self.name} (view {view})", e) from None

    def image(self, item: Any, index: int) -> torch.Tensor:
        return as_image(item, f"item {index} of {self.name}")

    def items(self, indices: Sequence[int]) -> list[Any]:
        """Items at `indices` (map-style only)."""
        return [self.item(int(i)) for i in indices]

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

    def crop_geometry(self, epoch: int, indices: torch.Tensor) -> torch.Tensor:
        """Every item's views are cut from an image of item 0's size (`_MakeViews`); a transform's have no crop."""
        if self.images.transform is not None:
            raise ConfigError(f"the method locates its views in their images, which unison knows for its own "
                              f"augmentation only; leave transform= out of the views of {self.images.name}")
        if self.make.size is None:   # made in loader processes: item 0's size, read here once
            h, w = self.images.image(self.images.first(), 0).shape[-2:]
            self.make.size = (int(h), int(w))
        sizes = torch.tensor(self.make.size, device=indices.device).expand(len(indices), 2)
        return self.make.augment.view_geometry(indices, epoch, self.seed, sizes)

    def _loader(self, batch_number: int) -> Iterator[dict[str, Any]]:
        if self.loader_workers == 0:   # in this process, without a DataLoader (which draws from torch's RNG)
            return (self.make((epoch, rows.tolist())) for epoch, rows in self.order.iter_from(batch_number))
        return map(raise_failed, job_loader(self.make, self.order, batch_number, self.loader_workers, self.device))

    def _same_batch_everywhere(self, epoch: int, first: int) -> None:
        """Every rank at the same (pass, position) of the iterable: one that yields fewer items on some rank (a shard
        missing on one host) would otherwise train on, its ranks in different passes. One tiny all-gather a step."""
        where = gather_no_grad(torch.tensor([[epoch, first]], dtype=torch.int64, device=self.device)).tolist()
        if any(w != where[0] for w in where):
            r = next(r for r, w in enumerate(where) if w != where[0])
            raise DataError(f"your dataset {self.images.name} yields different items on different ranks: rank 0 is at "
                            f"item {where[0][1]} of pass {where[0][0]}, rank {r} at item {where[r][1]} of pass "
                            f"{where[r][0]}; every rank must iterate the same items (the same shards on every host)")

    def _iterable(self, batch_number: int) -> Iterator[dict[str, Any]]:
        """Pass after pass over the iterable (epoch = pass): global batches of consecutive items, this rank's slice."""
        rows, b = local_slice(self.global_batch), self.global_batch
        epoch, skip = divmod(batch_number, self.batches_per_epoch) if self.images.length is not None else (0, batch_number)
        while True:
            position, batch, made = 0, [], 0
            for item in self.images.iterate():
                batch.append(item)
                position += 1
                if len(batch) < b:
                    continue
                if skip:
                    skip -= 1
                else:
                    first = position - b
                    self._same_batch_everywhere(epoch, first)
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
                     transform: Callable[[Any], Any] | None, *, max_batches: int | None = None) -> TrainData:
    """The `TrainData` of the user's `dataset` (and `transform`): views, image size, normalisation. `max_batches`:
    the global batches of the run, the epoch of an iterable dataset without ``__len__``. Its kNN sets, given labelled held-out
    items: `unison.data.own_knn.own_knn_sets`."""
    images = _own_images(spec, augmentation, dataset, transform)
    lengths = all_gather_object(images.length)   # every rank must read the same dataset: named before any step
    if len(set(lengths)) > 1:
        differ = next(r for r, n in enumerate(lengths) if n != lengths[0])
        raise DataError(f"your dataset {images.name} has {lengths[0]} items on rank 0 and {lengths[differ]} on rank "
                        f"{differ} (__len__): every rank must see the same items (the same files on every host)")
    size = _size_of(spec, images, transform)
    if images.iterable:   # the first items (an iterable has no others to pick)
        first_items = itertools.islice(images.iterate(), STATS_IMAGES)
        stats_images = torch.stack([square(images.image(x, i), size) for i, x in enumerate(first_items)])
    else:
        stats_images = images.uint8_at(_spaced(images.length or 0), size)
    mean, std = channel_stats(stats_images)
    augment = ViewAugmenter(augmentation, size, mean, std, **spec.augment_overrides())
    workers = spec.loader_workers if spec.loader_workers is not None else default_loader_workers(spec.world_size)
    source = OwnBatches(images, augment, spec.batch_size, spec.seed, device=device, loader_workers=workers,
                        batches_per_epoch=max_batches)
    n = images.length if images.length is not None else source.batches_per_epoch * spec.batch_size
    return TrainData(source, augment, "own", size, mean, std, n, None, None, None,
                     f"the data is your own dataset ({images.name}), with no held-out set: give val= (labelled "
                     "held-out items) for a kNN", own=images)


def own_image_size(spec: DataSpec, augmentation: str, dataset: Any, transform: Callable[[Any], Any] | None) -> int:
    """The size of the global views of the user's `dataset`, as `build_own_source` takes it (from its first item)."""
    return _size_of(spec, _own_images(spec, augmentation, dataset, transform), transform)


def _own_images(spec: DataSpec, augmentation: str, dataset: Any, transform: Callable[[Any], Any] | None) -> OwnImages:
    probe = ViewAugmenter(augmentation, spec.image_size or 32, (0.5,) * 3, (0.5,) * 3, **spec.augment_overrides())
    return OwnImages(dataset, transform, probe.num_views, spec.seed)


def _size_of(spec: DataSpec, images: OwnImages, transform: Callable[[Any], Any] | None) -> int:
    """The global views' size: the transform's (``--image-size`` must agree), else ``--image-size`` or the first
    item's shorter side."""
    first = images.first()
    if transform is not None:
        size = int(images.views(first, 0, 0)[0].shape[-1])
        if spec.image_size is not None and spec.image_size != size:
            raise ConfigError(f"image_size={spec.image_size}, but the transform makes {size} px views; leave "
                              "image_size out (the transform decides it) or make the transform's views that size")
        return size
    image = images.image(first, 0)
    return spec.image_size or default_image_size(int(image.shape[-2]), int(image.shape[-1]), f"dataset {images.name}")


def _spaced(n: int) -> list[int]:
    """`STATS_IMAGES` evenly spaced indices of `n` (the items the channel statistics are measured on)."""
    return [int(i) for i in np.linspace(0, n - 1, min(n, STATS_IMAGES)).round().astype(np.int64)]

