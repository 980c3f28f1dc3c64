"""Streamed data: folders, file lists and tar shards of images of any size and mode, decoded by loader workers.

The views of a sample must depend on (seed, epoch, index) only: not on the world size, the number
of loader workers or the layout the images are stored in; every sample is read once per epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.data_stream import BATCH, N, _stream, _take

from unison.data import global_batches
from unison.data.catalog import Catalog, open_catalog
from unison.data.decode import CropDecoder
from unison.distributed.testing import run_in_workers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def _views_on_this_rank(spec: str, batch: int, workers: int, count: int) -> list:
    return _take(_stream(spec, workers, batch=batch), 0, count)


@pytest.mark.distributed
def test_views_are_bit_identical_at_one_and_two_workers(data):
    multi = run_in_workers(_views_on_this_rank, 2, args=(data["shards"], BATCH, 1, 6), timeout_s=300)
    single = _take(_stream(data["shards"], 0), 0, 6)
    for step, (e, idx, views) in enumerate(single):
        (e0, i0, v0), (e1, i1, v1) = multi[0][step], multi[1][step]
        assert e == e0 == e1 and torch.equal(torch.cat([i0, i1]), idx)
        for v in range(len(views)):
            assert torch.equal(torch.cat([v0[v], v1[v]]), views[v]), f"step {step} view {v}"


class CountingCatalog(Catalog):
    """A catalog that appends ``epoch index`` to a log file for every sample it reads (any process)."""

    log_path = ""
    epoch = -1

    def read(self, i: int) -> bytes:
        with open(self.log_path, "a") as f:
            f.write(f"{self.epoch} {i}\n")
        return super().read(i)


class EpochNotingDecoder:
    """Tells the (per-process) catalog which epoch the job being decoded belongs to."""

    def __init__(self, inner: CropDecoder):
        self.inner = inner

    def __call__(self, job: tuple[int, list[int]]) -> dict:
        self.inner.catalog.epoch = job[0]
        return self.inner(job)


def _read_one_epoch(spec: str, log_path: str, workers: int) -> None:
    from unison.distributed import collectives as C

    cat = open_catalog(spec)
    cat.__class__ = CountingCatalog
    cat.log_path = f"{log_path}.rank{C.rank()}"
    source = _stream(spec, workers, catalog=cat)
    source.decoder = EpochNotingDecoder(source.decoder)
    _take(source, 0, N // BATCH)     # exactly one epoch; the loader may have read ahead into epoch 1


@pytest.mark.distributed
def test_each_sample_is_read_once_per_epoch_across_ranks_and_workers(data, tmp_path):
    log = str(tmp_path / "reads")
    run_in_workers(_read_one_epoch, 2, args=(data["shards"], log, 2), timeout_s=300)
    seen = []
    for rank in (0, 1):
        lines = [line.split() for line in Path(f"{log}.rank{rank}").read_text().splitlines()]
        epoch0 = sorted(int(i) for e, i in lines if e == "0")
        mine = torch.cat([b[rank * BATCH // 2:(rank + 1) * BATCH // 2] for b in global_batches(N, BATCH, 0, 7)])
        assert epoch0 == sorted(mine.tolist())          # this rank's slice of every batch, each sample once
        assert {e for e, _ in lines} <= {"0", "1"}      # read-ahead goes no further than the next epoch
        seen += epoch0
    assert sorted(seen) == list(range(N))               # every sample once per epoch, over both ranks
