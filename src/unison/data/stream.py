"""The streaming `BatchSource`: each rank reads and decodes only its own slice of every global batch.

For data that does not fit in memory (ImageNet-scale folders, file lists, tar shards).
The global order is the in-memory path's (`unison.data.batches.EpochOrder`): epoch e's global
batches are ``global_batches(n, B, e, seed)``; rank r takes its contiguous slice (`local_slice`).
That slice — ``(epoch, [sample indices])``, one *job* — is what the loader decodes:

* a `torch.utils.data.DataLoader` over this rank's jobs (``batch_size=None``: one job is
  one batch) with ``loader_workers`` worker processes, each job decoded whole by one
  worker (`CropDecoder`: read, header, crop boxes on the original size, DCT-scaled JPEG
  decode, antialiased resize, flip), ``prefetch`` jobs per worker in flight, pinned
  host memory when training on CUDA. The job stream is infinite (epoch after epoch), so
  the workers live for the whole run (``persistent_workers`` semantics without re-iterating);
* on the training device, `ViewAugmenter.finish` runs colour jitter, grayscale, blur,
  solarisation and normalisation batched, with the same per-sample draws (when the training
  device is the CPU, the loader processes run it on their job, in parallel: the training
  process would otherwise do it alone, on as many cores as it has threads).

Why the views do not depend on the world size or the number of loader workers: every
random number of a sample is `sample_uniform(seed, epoch, index, stream=view)`; which
process decodes a job changes nothing; the DataLoader returns jobs in order. Each sample is
read once per epoch, by the rank whose slice holds it (tested by counting reads).

Memory per rank grows with the data set by a few bytes per sample only: the catalog is a packed index (bytes per
sample, shared copy-on-write with the workers), the epoch order one int64 per sample, each image's size as last
read two int32 (`StreamingBatches.crop_geometry`: where its views lie in it); in flight are at most
``loader_workers * prefetch`` decoded jobs of ``B / W`` samples.

``decode="gpu"``: the workers only read the bytes; the training process decodes JPEGs
batched with ``torchvision.io.decode_jpeg(device="cuda")`` and crops, resizes and flips on
the GPU (`unison.data.gpu_decode`); views then differ from the CPU path's (another decoder
and resize) but are just as world-size invariant.

Example::

    source = StreamingBatches(open_catalog("/data/in1k/train"), augmenter, global_batch=1024, seed=0,
                              device=torch.device("cuda"), loader_workers=8)
    for epoch, indices, views in source.iter_from(0):
        ...
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from unison.distributed.signals import STOP_SIGNALS, die_with_parent
from unison.errors import DataError, UnisonError

from .augment import ViewAugmenter
from .batches import EpochOrder
from .decode import CropDecoder, unreadable_error
from .samples import Catalog

__all__ = ["StreamingBatches", "default_loader_workers", "job_loader", "raise_failed"]

def default_loader_workers(world_size_on_node: int) -> int:
    """Loader processes per rank when not given: the cores left per rank after the rank itself, 1 to 8."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // max(1, world_size_on_node) - 1))


class _RankJobs:
    """This rank's jobs ``(epoch, [indices])`` from global batch `start` on, forever (the DataLoader's sampler)."""

    def __init__(self, order: EpochOrder, start: int):
        self.order, self.start = order, start

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        for epoch, rows in self.order.iter_from(self.start):
            yield epoch, rows.tolist()


def _loader_init(parent_pid: int, worker_id: int) -> None:
    """In each loader process: die with the training worker; SIGTERM/SIGUSR1 end it (a forked one inherits the
    worker's stop handlers, which only record the request)."""
    die_with_parent(parent_pid)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


class _JobDataset(torch.utils.data.Dataset):
    """A map-style dataset whose "index" is a job: `DataLoader(sampler=jobs, batch_size=None)` decodes whole jobs."""

    def __init__(self, decode: Any):
        self.decode = decode

    def __getitem__(self, job: tuple[int, list[int]]) -> dict[str, Any]:
        try:
            return self.decode(job)
        except UnisonError as e:   # one line, not torch's "Caught ... in DataLoader worker process" and its traceback
            return {"raised": e}


def raise_failed(out: dict[str, Any]) -> dict[str, Any]:
    """A job's batch from `job_loader`, or the `UnisonError` its loader process raised, raised here as it was."""
    if "raised" in out:
        raise out["raised"]
    return out


def _as_is(item: Any) -> Any:
    return item


def job_loader(decode: Any, order: EpochOrder, batch_number: int, workers: int, device: torch.device,
               prefetch: int = 2) -> torch.utils.data.DataLoader:
    """A DataLoader of this rank's jobs ``(epoch, [indices])`` of `order` from global batch `batch_number` on, each
    job turned into one batch by ``decode(job)`` in one of `workers` loader processes (0: this process)."""
    # The loader processes die with this one (a SIGKILLed run leaves none, nor the resource tracker they hold
    # open). Forked on Linux: a spawned one re-imports torch before it can ask, and outlives a killed run for
    # as long; a forked one asks at once.
    fork = workers > 0 and sys.platform.startswith("linux")
    return torch.utils.data.DataLoader(
        _JobDataset(decode), sampler=_RankJobs(order, batch_number), batch_size=None, collate_fn=_as_is,
        num_workers=workers, pin_memory=device.type == "cuda", prefetch_factor=prefetch if workers else None,
        persistent_workers=workers > 0, worker_init_fn=functools.partial(_loader_init, os.getpid()),
        multiprocessing_context="fork" if fork else None)


class StreamingBatches:
    """`BatchSource` over a `Catalog`, decoded by loader worker processes; see the module docstring."""

    def __init__(self, catalog: Catalog, augment: ViewAugmenter, global_batch: int, seed: int, *,
                 device: torch.device, loader_workers: int = 0, on_corrupt: str = "skip",
                 positions: np.ndarray | None = None, decode: str = "cpu", prefetch: int = 2):
        n = len(positions) if positions is not None else len(catalog)
        self.order = EpochOrder(n, global_batch, seed, str(catalog.location))
        if augment.params["rotation"] > 0:
            raise DataError(f"the augmentation preset {augment.preset!r} rotates, which streamed data does not "
                            "support; use --data-mode memory or another preset")
        self.catalog, self.augment, self.global_batch, self.seed = catalog, augment, global_batch, seed
        self.device, self.loader_workers, self.prefetch, self.decode_on = device, loader_workers, prefetch, decode
        self.on_corrupt = on_corrupt
        self.n = n
        self.batches_per_epoch = self.order.batches_per_epoch
        if decode == "gpu":
            from .gpu_decode import BytesReader, GpuCropper

            self.decoder: Any = BytesReader(catalog, seed, on_corrupt, positions)
            self.gpu: Any = GpuCropper(augment, seed, device)
        else:
            # On the CPU the colour ops run in the loader processes too (in parallel); on a GPU, batched there.
            self.decoder = CropDecoder(catalog, augment, seed, on_corrupt, positions, finish=device.type == "cpu")
            self.gpu = None
        self.skipped: dict[str, str] = {}
        # (H, W) of each sample's image as its views were last cut from it (-1: not read yet): `crop_geometry`
        self._sizes = torch.full((n, 2), -1, dtype=torch.int32)

    def loader(self, batch_number: int) -> torch.utils.data.DataLoader:
        """The DataLoader of this rank's jobs from global batch `batch_number` on (what `iter_from` reads)."""
        return job_loader(self.decoder, self.order, batch_number, self.loader_workers, self.device, self.prefetch)

    def iter_from(self, batch_number: int) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        for out in map(raise_failed, self.loader(batch_number)):
            if out["error"] is not None:
                where, why = out["error"]
                raise unreadable_error(where, why, self.on_corrupt)
            self._report(out["skipped"])
            epoch = int(out["epoch"])
            indices = out["indices"].to(self.device, non_blocking=True)
            if "views" in out:  # finished in the loader process (training on the CPU)
                self._sizes[out["indices"]] = out["sizes"].to(torch.int32)
                yield epoch, indices, out["views"]
                continue
            if self.gpu is not None:
                crops = self.gpu(out, indices)
            else:
                crops = [c.to(self.device, non_blocking=True) for c in out["crops"]]
            self._sizes[out["indices"]] = out["sizes"].to("cpu", torch.int32)
            yield epoch, indices, self.augment.finish(crops, indices, epoch, self.seed)

    def crop_geometry(self, epoch: int, indices: torch.Tensor) -> torch.Tensor:
        """Each image's size is read where it is decoded (the loader processes, or the GPU): the sizes of the
        batches yielded so far are kept, one pair per sample, for this."""
        sizes = self._sizes[indices.cpu()]
        if bool((sizes < 0).any()):
            raise RuntimeError("crop_geometry asked for samples of a batch this source has not yielded")
        return self.augment.view_geometry(indices, epoch, self.seed, sizes.to(indices.device))

    def _report(self, skipped: list[tuple[str, str]]) -> None:
        """Record the unreadable files (each once, with why): the training loop reports them, once over the ranks
        (`unison.training.describe.UnreadableImages`), where each rank printing its own named the same file
        once per rank that met it."""
        for where, why in skipped:
            self.skipped.setdefault(where, why)
