"""`DataSpec`: what the data side of a run needs to know, and the rules on data sizes, each written once.

The data package never sees the training configuration: `unison.training.step.data_spec(cfg)`
copies the dozen fields it reads into this frozen value, and everything in `unison.data` that builds
a run's data (`unison.data.source.build_batch_source`, `choose_mode`) takes it.

The size rules live here, one function each, so every path states them with the same words:

* `check_subset`: ``--subset`` / ``--val-subset`` within the listed images of a folder, file
  list or shards;
* `check_batch`: one global batch within the training images;
* `check_step`: one optimiser step (``--grad-sync-every K`` micro-batches of the global batch) within one epoch
  of them: a longer step would silently span epochs, and one of K = 100,000 would run for hours unchecked.

Both are applied to listed data by `unison.data.source.open_checked`, which the pre-flight (before
any worker starts) and every build of listed data call; `check_batch` also guards the images a batch
source actually holds (`unison.data.batches.EpochOrder`, under every source: built-in sets, images
skipped as unreadable, sets given directly by `unison check` and the benchmarks).
(`unison.data.subsets.balanced_subset` keeps its own argument check, worded for the API: the
built-in sets, whose size is known only once loaded, reach it.)

Example::

    spec = DataSpec(data="/data/photos", batch_size=256, subset=5000, data_mode="stream")
    check_batch(f"--data {spec.data}", 5000, spec.batch_size)
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.config.limits import KNN_REFERENCE
from unison.errors import DataError

__all__ = ["BUILTIN", "BUILTIN_IMAGES", "BUILTIN_SIZES", "DataSpec", "check_batch", "check_step", "check_subset"]

BUILTIN = ("digits", "cifar10")   # held in memory always; no catalog to list
BUILTIN_SIZES = {"digits": 16, "cifar10": 32}   # their image sides: the default view size
BUILTIN_IMAGES = {"digits": 1438, "cifar10": 50000}   # their training splits (tests/data checks digits')


@dataclass(frozen=True)
class DataSpec:
    """The data of one run; the defaults are `TrainConfig`'s (``world_size`` aside)."""

    data: str = "digits"               # "digits", "cifar10", a folder, a file list or tar shards
    batch_size: int = 256              # the GLOBAL batch
    seed: int = 0                      # subsets, data order, augmentation
    val: str | None = None             # held-out data for kNN
    subset: int | None = None          # class-balanced subset of the training data
    val_subset: int | None = None      # ... of the held-out data
    knn_reference: int = KNN_REFERENCE  # training images in the kNN reference set, class-balanced (0: all)
    on_corrupt: str = "skip"           # unreadable images: "skip" or "error"
    data_mode: str = "auto"            # "auto", "memory" or "stream"
    decode: str = "cpu"                # "cpu" or "gpu" (streamed JPEGs decoded on the GPU)
    loader_workers: int | None = None  # loader processes per rank; None: from the cores per rank
    image_size: int | None = None      # training crop size; None: from the data
    world_size: int = 1                # ranks sharing this machine's cores (default loader_workers)
    global_views: int | None = None    # number of global views; None: the augmentation's (a method's view count)
    local_crops: int | None = None     # multi-crop: number of local crops; None: the augmentation's
    local_crop_size: int | None = None  # ... their size; None: the augmentation's (3/7 of image_size)
    grad_sync_every: int = 1           # micro-batches (global batches) per optimiser step
    normalisation: tuple[tuple[float, ...], tuple[float, ...]] | None = None   # (mean, std); None: the data's

    def augment_overrides(self) -> dict[str, int]:
        """The view counts and sizes given, as `ViewAugmenter` overrides (``n_global``, ``n_local``, ``local_size``)."""
        given = {"n_global": self.global_views, "n_local": self.local_crops, "local_size": self.local_crop_size}
        return {k: v for k, v in given.items() if v is not None}


def check_subset(what: str, n: int, subset: int | None) -> None:
    """DataError when `subset` asks for more than the `n` images of `what` (``"--data <spec>"``)."""
    if subset is not None and subset > n:
        raise DataError(f"{what} has {n} images, fewer than --subset/--val-subset {subset}; "
                        "lower it or leave it unset")


def check_batch(what: str, n: int, global_batch: int) -> None:
    """DataError when the `n` training images of `what` cannot fill one global batch (training would do nothing)."""
    if n < global_batch:
        raise DataError(f"{what} has {n} images, fewer than one global batch ({global_batch}); lower --batch-size")


def check_step(what: str, n: int, global_batch: int, grad_sync_every: int) -> None:
    """DataError when one optimiser step (`grad_sync_every` global batches) needs more than the `n` training images
    of `what`: the step would span epochs (each image seen twice in it), and a huge one would run unchecked."""
    if grad_sync_every > 1 and n < global_batch * grad_sync_every:
        raise DataError(f"{what} has {n:,} images, fewer than one optimiser step of --grad-sync-every "
                        f"{grad_sync_every:,} micro-batches of --batch-size {global_batch:,} "
                        f"({global_batch * grad_sync_every:,} images); give --grad-sync-every at most "
                        f"{max(1, n // global_batch):,} (or a smaller --batch-size)")
