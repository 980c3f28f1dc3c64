"""Which `BatchSource` a run reads, and the evaluation data beside it: `build_batch_source(spec, ...)`.

`spec` is a `DataSpec` (`unison.data.spec`), not the training configuration: ``unison train`` builds it
with `unison.training.step.data_spec`. ``--data-mode`` (``DataSpec.data_mode``):

* ``memory``: decode everything once into one uint8 tensor on the device (`InMemoryBatches`):
  the fastest path. Costs 3 x H x W bytes per image on every rank, plus one decode of the data (cached on
  disk). The kNN images of listed data are decoded once too and kept at the view size S, each rank its share
  (by default at most 5,000 reference + 2,000 held-out images over all ranks, 3 x S x S bytes each).
* ``stream``: each rank decodes its slice of each batch in loader worker processes
  (`StreamingBatches`). Costs CPU per step instead of memory: per rank, the packed index (about
  8 bytes + the path per image) and the decoded jobs in flight; nothing grows with the data.
* ``auto`` (default): ``memory`` when the decoded training set fits `MEMORY_BUDGET` (2 GiB per
  rank, counted at the size the memory path stores every image at, `stored_size`) and
  `SIZE_PROBES` evenly spaced images all have one size (the memory path would resize the others
  to it, distorting them), else ``stream``. ``digits`` and ``cifar10`` are always in memory;
  ``--decode gpu`` streams (its combination with ``memory`` is refused by `TrainConfig.validate`).

Across the two modes the samples, their order and every random draw of their views are the same; the pixels are
not (memory: one bilinear warp of the image held at one size; stream: a crop of the decoded original, resized with
antialiasing), nor exactly the normalisation statistics, so losses agree closely, not bit for bit (README, "Across
data modes").

Before anything is decoded, `open_checked` lists the data and applies the size rules of
`unison.data.spec` (``--subset`` within the data, one global batch within the images used): the
pre-flight (`unison.training.preflight`) calls it before any worker starts, and every build here.

Image size: ``--image-size``, else, for folders, lists and shards in both data modes, the median shorter side of
`SIZE_PROBES` evenly spaced images (their headers), at most 224 (`unison.data.view_size`: one rule, decided once, for
the pre-flight, both data paths, ``unison eval`` and ``unison embed``); when those images differ in size, one
line (`TrainData.size_note`) says what was chosen and why. Given or built-in sets: their size. Normalisation: the
memory path's per-channel statistics of all images; streamed: of `STATS_IMAGES` evenly spaced images at the
training size; or the statistics ``spec.normalisation`` gives (an encoder evaluated on other data is fed what it was
trained on).

kNN evaluation needs labelled held-out data, and never scores training images:

* ``digits`` / ``cifar10``: their own held-out split;
* otherwise the ``--val`` data (classes the training data has, `unison.data.evalsets.map_labels`);
  without ``--val``, or when either side has no labels, kNN is skipped and `TrainData.knn_skipped` says why;
* in both data modes the sets are bounded the same way (`unison.data.evalsets`: at most `KNN_REFERENCE`
  (5,000) reference and `KNN_QUERIES` (2,000) query images, or ``--val-subset``); images of folders,
  lists and shards are decoded at the training size (shorter side resized, centre square, EXIF
  orientation applied) each time kNN runs, in chunks: memory holds the features, never the images.

Training images outside the batches: `TrainData.images_at` (uint8, or decoded on demand when streamed) and
`TrainData.labels_at` serve the label-free signals' held-back set and the online probe (`unison.training.signals`).

Example::

    data = build_batch_source(DataSpec(data="/data/photos", batch_size=256), device, "simclr")
    for epoch, indices, views in data.source.iter_from(0):
        ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unison.errors import ConfigError, DataError
from unison.paths import is_inside, same_file

from .augment import ViewAugmenter
from .batches import BatchSource, InMemoryBatches
from .catalog import open_catalog
from .datasets import load_dataset
from .evalsets import KNN_QUERIES, KNN_REFERENCE, KnnSets, LazyImages, knn_sets, map_labels
from .memory import free_device_memory, load_catalog, physical_memory
from .samples import Catalog
from .spec import BUILTIN, BUILTIN_IMAGES, BUILTIN_SIZES, DataSpec, check_batch, check_step, check_subset
from .subsets import balanced_subset, channel_stats
from .tensor_dataset import ImageTensorDataset
from .view_size import (
    ViewSize,
    default_image_size,
    default_view_size,
    sampled_sizes,
    stored_size,
)

__all__ = ["KNN_QUERIES", "KNN_REFERENCE", "MEMORY_BUDGET", "KnnSets", "LazyImages", "TrainData", "ViewSize",
           "build_batch_source", "check_label_spaces", "choose_mode", "data_mode_of", "default_view_size",
           "open_checked", "planned_image_size", "planned_images", "stream_stats", "subset_positions"]

MEMORY_BUDGET = 2 * 2**30
STATS_IMAGES = 256


@dataclass
class TrainData:
    """What `build_batch_source` hands the training step."""

    source: BatchSource
    augment: ViewAugmenter
    mode: str                                  # "memory", "stream" or "own" (the user's dataset)
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_images: int                            # training images (after --subset)
    train_set: ImageTensorDataset | None       # the decoded sets (memory mode)
    val_set: ImageTensorDataset | None
    knn: KnnSets | None
    knn_skipped: str | None                    # why there is no kNN evaluation, when there is none
    catalog: Catalog | None = None             # streamed: the listed images, and the training set's positions
    positions: np.ndarray | None = None        # in it (None: all of them)
    on_corrupt: str = "skip"
    own: Any = None                            # the user's dataset (`unison.data.own.OwnImages`): mode "own"
    size_note: str | None = None               # images of several sizes: the view size chosen, and why

    def unreadable(self) -> dict[str, str]:
        """The training images this rank found unreadable so far and skipped (``--on-corrupt skip``): name -> why.
        In memory every rank decoded all of them (the same on every rank); streamed, each rank its own slices."""
        if self.train_set is not None:
            return self.train_set.unreadable
        return dict(getattr(self.source, "skipped", {}))

    @property
    def random_access(self) -> bool:
        """Whether `images_at` can read any training image (not so for the user's iterable dataset)."""
        return self.own is None or not self.own.iterable

    @property
    def labelled(self) -> bool:
        """Whether the training images have labels (the online probe's condition)."""
        if self.train_set is not None:
            return self.train_set.labelled
        return self.catalog is not None and self.catalog.labelled

    @property
    def num_classes(self) -> int:
        classes = self.train_set.classes if self.train_set is not None else self.catalog.classes if self.catalog else []
        return len(classes)

    def images_at(self, indices: np.ndarray, device: torch.device) -> Any:
        """Training images at `indices` (0 .. num_images-1) as uint8: a tensor (memory) or `LazyImages` decoded at
        the training size, shorter side resized and centre square (stream)."""
        if self.train_set is not None:
            return self.train_set.images[torch.from_numpy(indices).to(self.train_set.images.device)]
        if self.own is not None:   # the user's dataset: its items, shorter side resized and centre square
            return self.own.uint8_at(indices.tolist(), self.image_size).to(device)
        assert self.catalog is not None
        where = self.positions[indices] if self.positions is not None else indices
        return LazyImages(self.catalog, where, self.image_size, device, self.on_corrupt)

    def labels_at(self, indices: torch.Tensor) -> torch.Tensor:
        """int64 labels (-1: none) of training images at `indices`, on the device of `indices`."""
        if self.train_set is not None:
            return self.train_set.labels.to(indices.device)[indices]
        assert self.catalog is not None
        idx = indices.cpu().numpy()
        where = self.positions[idx] if self.positions is not None else idx
        return torch.from_numpy(self.catalog.labels[where]).to(indices.device)


def open_checked(spec: DataSpec, role: str = "data") -> Catalog | None:
    """The catalog of ``--data`` (`role` "data") or ``--val`` ("val"), None for a built-in set, after the size rules.

    ``--subset`` / ``--val-subset`` must fit the listed images, and the training images used must fill one
    global batch. The pre-flight and `build_batch_source` both call this, so they fail with the same words.
    """
    where, subset = (spec.data, spec.subset) if role == "data" else (spec.val, spec.val_subset)
    if role == "data" and where in BUILTIN:   # their sizes are known: a batch and a step fit, before any decode
        n = min(BUILTIN_IMAGES[where], subset or BUILTIN_IMAGES[where])
        check_batch(f"--data {where}", n, spec.batch_size)
        check_step(f"--data {where}", n, spec.batch_size, spec.grad_sync_every)
    if where is None or where in BUILTIN:
        return None
    if role == "val":
        check_held_out(where, spec.data)
    catalog = open_catalog(where, f"--{role}")
    n = len(catalog)
    check_subset(f"--{role} {where}", n, subset)
    if role == "data":
        check_batch(f"--{role} {where}", min(n, subset or n), spec.batch_size)
        check_step(f"--{role} {where}", min(n, subset or n), spec.batch_size, spec.grad_sync_every)
    return catalog


def check_held_out(val: str, data: str) -> None:
    """``--val`` must not overlap ``--data`` (the same folder, list or shard, or one inside the other): the kNN
    would score images the encoder was trained on, and report a higher top-1 than held-out data gives."""
    if data in BUILTIN or not val or not data or not (os.path.exists(val) and os.path.exists(data)):
        return
    if same_file(val, data) or is_inside(val, data) or is_inside(data, val):
        how = "is" if same_file(val, data) else "overlaps"
        raise DataError(f"--val {val} {how} the training data (--data {data}): the kNN would score images the "
                        "encoder trained on; give held-out images in a separate place, or leave --val out")


def data_mode_of(spec: DataSpec, catalog: Catalog | None, device_free: int | None = None) -> str:
    """The data mode a run of `spec` trains in (`choose_mode` on the images it trains on)."""
    return choose_mode(spec, catalog, spec.subset or (len(catalog) if catalog else 0), device_free)


def choose_mode(spec: DataSpec, catalog: Catalog | None, n: int, device_free: int | None = None) -> str:
    """"memory" or "stream" for `spec.data` (see the module docstring). `device_free`: the free bytes of the GPU
    that memory mode would hold the images on (None: they stay in the host's memory)."""
    if catalog is None:  # digits / cifar10
        if spec.data_mode == "stream" or spec.decode == "gpu":
            raise ConfigError(f"--data {spec.data} is built in and always held in memory; --data-mode stream and "
                              "--decode gpu are for folders, file lists and shards")
        return "memory"
    if spec.decode == "gpu":  # with --data-mode memory refused by TrainConfig.validate
        return "stream"
    if spec.data_mode == "memory":
        _check_fits_in_memory(catalog, n, device_free)
    if spec.data_mode != "auto":
        return spec.data_mode
    sizes = sampled_sizes(catalog)
    h, w = stored_size(sizes)
    if n * 3 * h * w > MEMORY_BUDGET:
        return "stream"
    return "memory" if len(set(sizes)) == 1 else "stream"


def _check_fits_in_memory(catalog: Catalog, n: int, device_free: int | None = None) -> None:
    """``--data-mode memory`` holds every training image decoded, 3 x H x W bytes at the size it stores them at
    (`stored_size`), in each worker: refuse data whose one copy exceeds this machine's RAM (each worker would start
    decoding it all), or the GPU's free memory it would be copied to (`device_free`; CUDA's out-of-memory after the
    decode)."""
    h, w = stored_size(sampled_sizes(catalog))
    need = n * 3 * h * w
    held = f"--data-mode memory would hold {n:,} images decoded at {h}x{w} px ({need / 2**30:,.1f} GiB"
    instead = "use --data-mode stream (or auto), or fewer images (--subset)"
    ram = physical_memory()
    if ram is not None and need > ram:
        raise ConfigError(f"{held} in each worker), more than this machine's {ram / 2**30:,.1f} GiB of memory; "
                          f"{instead}")
    if device_free is not None and need > device_free:
        raise ConfigError(f"{held} on each GPU), more than the {device_free / 2**30:,.1f} GiB free on this GPU; "
                          f"{instead}")


def build_batch_source(spec: DataSpec, device: torch.device, augmentation: str, *,
                       train_set: ImageTensorDataset | None = None, val_set: ImageTensorDataset | None = None,
                       catalog: Catalog | None = None, val_catalog: Catalog | None = None) -> TrainData:
    """The `BatchSource` of `spec.data` (or of the given in-memory `train_set`), its augmenter and kNN sets.
    `catalog`, `val_catalog`: `open_checked(spec)`'s of ``--data`` and ``--val``, when the run listed them already
    (a run lists its data once: `unison.training.resolve.plan_run`); else they are listed here."""
    if train_set is not None:
        return _memory(spec, device, augmentation, None, train_set, val_set, None)
    if catalog is None and val_catalog is None:
        catalog, val_catalog = open_checked(spec), _val_catalog(spec)
    mode = data_mode_of(spec, catalog, free_device_memory(device))
    if mode == "memory":
        return _memory(spec, device, augmentation, catalog, None, None, val_catalog)
    assert catalog is not None
    return _stream(spec, device, augmentation, catalog, val_catalog)


def _memory(spec: DataSpec, device: torch.device, augmentation: str, catalog: Catalog | None,
            train_set: ImageTensorDataset | None, val_set: ImageTensorDataset | None,
            val_catalog: Catalog | None) -> TrainData:
    given = train_set is not None
    if train_set is None:
        if catalog is None:
            train_set = load_dataset(spec.data, "train", subset=spec.subset, on_corrupt=spec.on_corrupt,
                                     seed=spec.seed)
        else:
            train_set = load_catalog(catalog, spec.subset, spec.on_corrupt, spec.seed,
                                     size=stored_size(sampled_sizes(catalog)), warn_unreadable=False)
        train_set = train_set.to(device)
    height, width = train_set.images.shape[-2:]
    chosen = default_view_size(catalog, spec.data) if catalog is not None and spec.image_size is None else None
    image_size = spec.image_size or (chosen.size if chosen else default_image_size(height, width, spec.data))
    mean, std = spec.normalisation or (train_set.mean, train_set.std)
    augment = ViewAugmenter(augmentation, image_size, mean, std, **spec.augment_overrides())
    source = InMemoryBatches(train_set, augment, spec.batch_size, spec.seed)   # checks one batch fits
    knn: KnnSets | None
    knn_skipped: str | None
    if given and val_set is None:
        knn, knn_skipped = None, "no held-out data was given"
    elif catalog is not None:   # the kNN sets of listed data: decoded when embedded, as when streamed
        pick = subset_positions(catalog, spec.subset, spec.seed)
        knn, knn_skipped = knn_sets(spec, image_size, device, catalog=catalog, pick=pick, train_set=train_set,
                                    val_catalog=val_catalog, val_set=val_set)
    else:
        knn, knn_skipped = knn_sets(spec, image_size, device, train_set=train_set,
                                    val_catalog=None if val_set is not None else val_catalog, val_set=val_set)
    if knn is not None:   # decoded once, now: the start-up pays it, not each kNN (nor a budget's final one)
        for images, what in ((knn.reference, "reference set"), (knn.queries, "queries")):
            if isinstance(images, LazyImages):
                images.keep_share(what)
    return TrainData(source, augment, "memory", image_size, tuple(mean), tuple(std), len(train_set),
                     train_set, val_set, knn, knn_skipped, size_note=chosen.note if chosen else None)


def _val_catalog(spec: DataSpec) -> Catalog | None:
    """The catalog of ``--val`` when it is a folder, list or shards (None: none given, or a built-in set)."""
    return open_catalog(spec.val, "--val") if spec.val is not None and spec.val not in BUILTIN else None


def check_label_spaces(spec: DataSpec, catalog: Catalog | None, val: Catalog | None) -> None:
    """The pre-flight's check of the held-out labels against the training labels (`map_labels`, the rule
    `knn_sets` applies in every worker): a mismatch is one line before any worker starts."""
    if catalog is not None and val is not None and catalog.classes and val.classes:
        map_labels(catalog.classes, val.classes, spec.data, str(spec.val))


def planned_images(spec: DataSpec, catalog: Catalog | None) -> int:
    """How many training images a run of `spec` reads (`catalog`: `open_checked`'s; ``--subset`` applied)."""
    n = len(catalog) if catalog is not None else BUILTIN_IMAGES[spec.data]
    return min(n, spec.subset or n)


def subset_positions(catalog: Catalog, subset: int | None, seed: int) -> np.ndarray:
    """The catalog indices of the training images in use: all, or the class-balanced ``--subset``."""
    if subset is None:
        return np.arange(len(catalog))
    return balanced_subset(torch.from_numpy(catalog.labels), subset, seed).numpy()


def stream_stats(catalog: Catalog, pick: np.ndarray, size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of `STATS_IMAGES` evenly spaced images of `pick`, as training normalises streamed
    data (unreadable ones left out)."""
    sample = pick[np.linspace(0, len(pick) - 1, min(len(pick), STATS_IMAGES)).round().astype(np.int64)]
    images, ok = LazyImages(catalog, sample, size, torch.device("cpu"), "skip").decode()
    if not bool(ok.any()):
        raise DataError(f"no readable images in {catalog.location} (the {len(sample)} read for the channel "
                        "statistics all failed)")
    return channel_stats(images[ok])


def _stream(spec: DataSpec, device: torch.device, augmentation: str, catalog: Catalog,
            val_catalog: Catalog | None) -> TrainData:
    from .stream import StreamingBatches, default_loader_workers

    positions = None if spec.subset is None else subset_positions(catalog, spec.subset, spec.seed)
    pick = positions if positions is not None else np.arange(len(catalog))
    chosen = default_view_size(catalog, spec.data) if spec.image_size is None else None
    image_size = spec.image_size or chosen.size   # type: ignore[union-attr]
    mean, std = spec.normalisation or stream_stats(catalog, pick, image_size)
    augment = ViewAugmenter(augmentation, image_size, mean, std, **spec.augment_overrides())
    workers = spec.loader_workers if spec.loader_workers is not None else default_loader_workers(
        spec.world_size)
    source = StreamingBatches(catalog, augment, spec.batch_size, spec.seed, device=device, loader_workers=workers,
                              on_corrupt=spec.on_corrupt, positions=positions, decode=spec.decode)
    knn, knn_skipped = knn_sets(spec, image_size, device, catalog=catalog, pick=pick, val_catalog=val_catalog)
    return TrainData(source, augment, "stream", image_size, mean, std, len(pick), None, None, knn, knn_skipped,
                     catalog=catalog, positions=positions, on_corrupt=spec.on_corrupt,
                     size_note=chosen.note if chosen else None)


def planned_image_size(spec: DataSpec, catalog: Catalog | None,
                       train_set: ImageTensorDataset | None = None) -> int | None:
    """The size of the global views, as the build takes it (`catalog`: `open_checked`'s): ``--image-size``, else
    the data's default (the images given in memory, `default_view_size` of listed data, or a built-in set's size);
    None when unknown (the user's own dataset)."""
    if spec.image_size is not None:
        return spec.image_size
    if train_set is not None:
        height, width = train_set.images.shape[-2:]
        return default_image_size(height, width, spec.data)
    if catalog is not None:
        return default_view_size(catalog, spec.data).size
    return BUILTIN_SIZES.get(spec.data)


