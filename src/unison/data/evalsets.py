"""The kNN evaluation sets: one rule for training (either data mode), `unison eval` and `unison embed`.

* **Bounded**: the reference set is a class-balanced subset of at most ``--knn-reference`` (default
  `KNN_REFERENCE`, 5,000; 0: all, as published kNN figures use) of the training images in use (after
  ``--subset``), the queries at most ``--val-subset`` or `KNN_QUERIES` (2,000) held-out images, both
  chosen by the run's seed (`knn_subsets`). In-memory and streamed training, and ``unison eval`` on the same
  run, pick the same images.
* **Streamed**: images of folders, file lists and shards are decoded when embedded, one batch at a
  time (`LazyImages`: the shorter side resized to the view size, the centre square, EXIF orientation
  applied: `unison.data.decode.decode_centre`): memory holds the features, never the images, so it does
  not grow with the data. The built-in sets and sets given in memory are tensors already. With
  ``--data-mode memory`` each rank decodes its share once, at the start, and keeps it on the device
  (`LazyImages.keep_share`); the reference set is the decoded training images' rows instead where they hold
  it at the run's size (`held_rows`; CIFAR-10 at 32 px: the same pixels, 45,000 fewer decodes at
  ``--knn-reference 0``), as it is for sets given in memory.
* **Unreadable images** follow ``--on-corrupt``: ``skip`` leaves them out of the sets (`LazyImages.decode`
  says which rows decoded; `unison.eval.knn` reports one total over all ranks, once), ``error`` is a
  `DataError` naming the file. PIL's warnings while decoding are part of that count, never printed raw.
* **Labels**: the held-out classes must be the training classes, or map onto them by name without
  ambiguity (`map_labels`: a held-out folder missing a class, class folders named ``0`` .. ``9`` against a
  file list's integer labels); anything else is one line saying what to fix. The pre-flight applies the
  same rule before any worker starts (`unison.training.preflight`).

Example::

    sets, why = knn_sets(spec, 64, torch.device("cpu"), catalog=cat, pick=np.arange(len(cat)))
    images, ok = sets.reference.decode(0, 512)     # uint8 [512, 3, 64, 64]; ok[k] False: unreadable
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from unison.config.fields import ascii_digits
from unison.config.limits import KNN_REFERENCE
from unison.distributed.collectives import contiguous_share, rank, world_size
from unison.errors import ConfigError, DataError
from unison.progress import Progress

from .decode import decode_centre
from .files import decode_reason
from .samples import Catalog
from .spec import BUILTIN, DataSpec
from .subsets import balanced_subset
from .tensor_dataset import ImageTensorDataset

__all__ = ["KNN_QUERIES", "KNN_REFERENCE", "KnnSets", "LazyImages", "knn_sets", "knn_subsets", "map_labels"]

KNN_QUERIES = 2_000


@dataclass
class KnnSets:
    """Reference and query images (uint8 tensors, or `LazyImages`) with their labels, on the device."""

    reference: Any
    reference_labels: torch.Tensor
    queries: Any
    query_labels: torch.Tensor
    num_classes: int


@dataclass
class _Unreadable:
    """What the decodes of one set (and all its slices) found unreadable; shared by the slices."""

    files: dict[int, str] = field(default_factory=dict)   # catalog index -> "file (reason)"
    reported: bool = False


class _Kept:
    """Decoded rows [lo, hi) of one `LazyImages` set (this rank's share; shared by the set's contiguous slices),
    kept on the device: with ``--data-mode memory`` a kNN every few epochs would otherwise decode the same JPEGs
    on the host each time, out of the run's budget, and the final kNN would overrun the budget by that decode.
    Rows outside [lo, hi) are neither kept nor served."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.images: torch.Tensor | None = None
        self.ok: torch.Tensor | None = None
        self.done = np.zeros(hi - lo, dtype=bool)

    def _rows(self, start: int, stop: int) -> slice | None:
        """Rows [start, stop) of the set as a slice of the kept tensors; None when they are not all kept here."""
        return slice(start - self.lo, stop - self.lo) if self.lo <= start and stop <= self.hi else None

    def get(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = self._rows(start, stop)
        if rows is None or self.images is None or self.ok is None or not self.done[rows].all():
            return None
        return self.images[rows], self.ok[rows]

    def put(self, start: int, images: torch.Tensor, ok: torch.Tensor) -> None:
        rows = self._rows(start, start + images.shape[0])
        if rows is None:
            return
        if self.images is None:
            self.images = torch.zeros((self.hi - self.lo, *images.shape[1:]), dtype=images.dtype,
                                      device=images.device)
            self.ok = torch.zeros(self.hi - self.lo, dtype=torch.bool, device=ok.device)
        self.images[rows] = images
        self.ok[rows] = ok   # type: ignore[index]
        self.done[rows] = True


class LazyImages:
    """Images of a catalog decoded on demand at ``size`` (shorter side resized, centre square, upright).

    ``images[a:b]`` is another `LazyImages` (sharing the record of unreadable files); ``images.decode(a, b)``
    the uint8 ``[b-a, 3, size, size]`` tensor on `device` and a bool ``[b-a]`` mask of the rows that decoded
    (unreadable rows are black), decoded in a thread pool (PIL releases the GIL while decoding and resizing).
    With ``on_corrupt="error"`` an unreadable image is a `DataError` naming it. ``keep_share()`` decodes this
    rank's share now and keeps it on the device (`_Kept`; the in-memory data mode, which holds the training
    images there already): later decodes of those rows decode nothing.
    """

    def __init__(self, catalog: Catalog, indices: np.ndarray, size: int, device: torch.device, on_corrupt: str,
                 unreadable: _Unreadable | None = None, *, kept: _Kept | None = None, offset: int = 0):
        self.catalog, self.indices, self.size, self.device, self.on_corrupt = catalog, indices, size, device, on_corrupt
        self.unreadable = unreadable if unreadable is not None else _Unreadable()
        self.kept, self.offset = kept, offset   # rows of the set this one is a slice of: offset + i

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.indices), 3, self.size, self.size)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, part: slice) -> LazyImages:
        rows = range(len(self.indices))[part]
        kept = self.kept if rows.step == 1 else None   # a contiguous slice shares the kept decodes
        return LazyImages(self.catalog, self.indices[part], self.size, self.device, self.on_corrupt, self.unreadable,
                          kept=kept, offset=self.offset + (rows.start if kept is not None else 0))

    def decode(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        stop = len(self.indices) if stop is None else min(stop, len(self.indices))
        if self.kept is not None:
            found = self.kept.get(self.offset + start, self.offset + stop)
            if found is not None:
                return found
        images, ok = self._decode(start, stop)
        if self.kept is not None:
            self.kept.put(self.offset + start, images, ok)
        return images, ok

    def keep_share(self, what: str, batch_size: int = 1024) -> None:
        """Decode this process's share of the set now (the rows this rank embeds: `contiguous_share`), so that
        a kept set's kNNs decode nothing: the start-up of an in-memory run pays it, as it pays the training
        set's decode, instead of a time-budgeted run's final kNN."""
        share = contiguous_share(len(self.indices), rank(), world_size())
        self.kept = _Kept(self.offset + share.start, self.offset + share.stop)
        progress = Progress(f"decoding the kNN {what} into memory:", share.stop - share.start, len(self.indices),
                            show=rank() == 0)
        for i in range(share.start, share.stop, batch_size):
            self.decode(i, min(i + batch_size, share.stop))
            progress(min(i + batch_size, share.stop) - share.start)

    def _decode(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:

        chosen = self.indices[start:stop]
        out = np.zeros((len(chosen), self.size, self.size, 3), dtype=np.uint8)

        def one(k: int) -> str | None:
            try:
                out[k] = decode_centre(self.catalog.read(int(chosen[k])), self.size)
                return None
            except Exception as e:
                return f"{self.catalog.describe(int(chosen[k]))} ({decode_reason(e)})"

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # PIL's notes on odd files: an unreadable one is counted below
            errors = list(_pool().map(one, range(len(chosen))))
        bad = [k for k, e in enumerate(errors) if e]
        if bad and self.on_corrupt == "error":
            raise DataError(f"cannot read image {errors[bad[0]]}; fix or remove it, or pass --on-corrupt skip")
        for k in bad:
            self.unreadable.files[int(chosen[k])] = str(errors[k])
        ok = torch.ones(len(chosen), dtype=torch.bool)
        ok[bad] = False
        return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous().to(self.device), ok.to(self.device)


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    """This process's decoding threads, kept for its life. Why not a pool per batch: every new thread may get
    a malloc arena of its own, and the freed decode buffers left in up to 8 x cores arenas would make the peak
    memory of a kNN grow with the number of batches it decodes."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():   # a forked child has none of its parent's threads
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                 thread_name_prefix="unison-decode"))
    return _POOL[1]


def knn_subsets(reference_labels: torch.Tensor, query_labels: torch.Tensor, val_subset: int | None,
                seed: int, reference: int = KNN_REFERENCE) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the reference and query images among the given ones (see the module docstring); `reference`
    0 keeps every training image (the protocol of Lightly's and solo-learn's published kNN figures)."""
    n_ref = len(reference_labels) if reference == 0 else min(len(reference_labels), reference)
    ref = balanced_subset(reference_labels, n_ref, seed)
    query = balanced_subset(query_labels, min(len(query_labels), val_subset or KNN_QUERIES), seed)
    return ref, query


def map_labels(train_classes: list[str], val_classes: list[str], data: str, val: str) -> np.ndarray:
    """Held-out class index -> training class index; ConfigError (one line, what to fix: the pairing of --data
    and --val) when there is no unambiguous one.

    Equal class lists map to themselves; otherwise by name, which must all be training classes: a held-out
    folder without one of the classes, or class folders named ``0`` .. ``9`` against a file list's integer
    labels (``0`` .. ``9`` too, whose folder order ``0, 1, 10, 2`` differs). Integer labels against class
    names (``3`` vs ``cat``) have no such mapping: the user says which is which."""
    if val_classes == train_classes:
        return np.arange(len(val_classes), dtype=np.int64)
    index = {c: k for k, c in enumerate(train_classes)}
    missing = [c for c in val_classes if c not in index]
    if not missing:
        return np.asarray([index[c] for c in val_classes], dtype=np.int64)
    numbers = [all(ascii_digits(c) for c in cs) for cs in (train_classes, val_classes)]
    if numbers[0] != numbers[1]:
        ints, names = (data, val) if numbers[0] else (val, data)
        raise ConfigError(f"--data {data} and --val {val} label classes differently: {ints} has integer labels "
                        f"(0, 1, ...), {names} class names ({_some(val_classes if numbers[0] else train_classes)}); "
                        f"give both the same labels: names in the file list ('path<TAB>name'), or class folders "
                        f"named 0, 1, ... in the order of the integers")
    raise ConfigError(f"--val {val} has classes {_some(missing)} that --data {data} does not have (its classes: "
                    f"{_some(train_classes)}); give held-out data labelled like the training data")


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def held_rows(train_set: ImageTensorDataset | None, indices: np.ndarray, size: int) -> torch.Tensor | None:
    """The rows of `train_set` that hold catalog images `indices` as the kNN decodes them at `size` (None unless
    it holds them all): images decoded at their stored size (`ImageTensorDataset.catalog_rows`) of ``size`` x
    ``size`` px, which `decode_centre` returns unchanged (CIFAR-10 at 32 px)."""
    if train_set is None or train_set.catalog_rows is None or train_set.images.shape[-2:] != (size, size):
        return None
    rows = train_set.catalog_rows[torch.from_numpy(np.asarray(indices, dtype=np.int64))]
    return rows if bool((rows >= 0).all()) else None


def knn_sets(spec: DataSpec, size: int, device: torch.device, *, catalog: Catalog | None = None,
             pick: np.ndarray | None = None, train_set: ImageTensorDataset | None = None,
             val_catalog: Catalog | None = None, val_set: ImageTensorDataset | None = None
             ) -> tuple[KnnSets | None, str | None]:
    """The kNN sets of the training data (`catalog` rows `pick`, or the in-memory `train_set`; given both, the
    catalog's images taken from `train_set` where it holds them: `held_rows`) against the held-out data
    (`val_catalog` of ``spec.val``, the in-memory `val_set`, or a built-in set's held-out split); (None, why)
    when there is no labelled held-out data."""
    classes = catalog.classes if catalog is not None else (train_set.classes if train_set is not None else [])
    if not classes:
        return None, f"the training data {spec.data} has no labels"
    if val_set is None and val_catalog is None:
        if spec.val is None and spec.data not in BUILTIN:
            return None, "no --val held-out data was given (kNN never scores the training images)"
        if catalog is not None:
            return None, f"--val {spec.val} is a built-in set; give held-out data in the training data's layout"
        assert (spec.val or spec.data) in BUILTIN, "the caller opens the catalog of a --val folder, list or shards"
        from .datasets import load_dataset

        val_set = load_dataset(spec.val or spec.data, "val", on_corrupt=spec.on_corrupt, seed=spec.seed)
    val_classes = val_catalog.classes if val_catalog is not None else val_set.classes   # type: ignore[union-attr]
    if not val_classes:
        return None, f"the held-out data {spec.val} has no labels"
    mapping = torch.from_numpy(map_labels(classes, val_classes, spec.data, str(spec.val or spec.data)))
    ref_labels = torch.from_numpy(catalog.labels[pick]) if catalog is not None else train_set.labels.cpu()  # type: ignore[union-attr,index]
    val_labels = mapping[torch.from_numpy(val_catalog.labels) if val_catalog is not None
                         else val_set.labels.cpu()]   # type: ignore[union-attr]
    ref, query = knn_subsets(ref_labels, val_labels, spec.val_subset, spec.seed, spec.knn_reference)
    if catalog is not None:
        chosen = pick[ref.numpy()]   # type: ignore[index]
        rows = held_rows(train_set, chosen, size)
        if rows is not None and train_set is not None:   # decoded for training already: its rows, as below
            reference: Any = train_set.images[rows.to(train_set.images.device)]
        else:
            reference = LazyImages(catalog, chosen, size, device, spec.on_corrupt)
    else:
        reference = train_set.images[ref.to(train_set.images.device)]   # type: ignore[union-attr]
    if val_catalog is not None:
        queries: Any = LazyImages(val_catalog, query.numpy(), size, device, spec.on_corrupt)
    else:
        queries = val_set.images[query.to(val_set.images.device)]   # type: ignore[union-attr]
    return KnnSets(reference, ref_labels[ref].to(device), queries, val_labels[query].to(device), len(classes)), None
