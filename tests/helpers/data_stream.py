"""Helpers shared by the unit and distributed tests of test_data_stream."""

from __future__ import annotations

import pytest
import torch

from unison.data import ViewAugmenter
from unison.data.catalog import Catalog, open_catalog
from unison.data.generated import write_file_list, write_image_folder, write_shards
from unison.data.stream import StreamingBatches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


N, BATCH, SIZE = 120, 24, 24   # 5 global batches per epoch, every sample in one of them


MEAN, STD = (0.5, 0.45, 0.4), (0.25, 0.25, 0.25)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """The same 120 images (JPEG/PNG/BMP/WebP; RGB, L, CMYK, P, RGBA, 16-bit) as a folder, a list and shards."""
    tmp = tmp_path_factory.mktemp("stream")
    files = write_image_folder(tmp / "train", N, classes=3, sizes=(16, 72), seed=3)
    write_file_list(tmp / "train", files, tmp / "list.txt")
    write_shards(tmp / "train", files, tmp / "shards", per_shard=50)
    return {"folder": str(tmp / "train"), "list": str(tmp / "list.txt"), "shards": str(tmp / "shards"),
            "tmp": str(tmp)}


def _augmenter(preset: str = "simclr") -> ViewAugmenter:
    return ViewAugmenter(preset, SIZE, MEAN, STD)


def _stream(spec: str, workers: int, batch: int = BATCH, decode: str = "cpu", on_corrupt: str = "skip",
            catalog: Catalog | None = None, preset: str = "simclr") -> StreamingBatches:
    return StreamingBatches(catalog or open_catalog(spec), _augmenter(preset), batch, seed=7,
                            device=torch.device("cpu"), loader_workers=workers, on_corrupt=on_corrupt, decode=decode)


def _take(source: StreamingBatches, start: int, count: int) -> list[tuple[int, torch.Tensor, list[torch.Tensor]]]:
    it = source.iter_from(start)
    out = [next(it) for _ in range(count)]
    it.close()  # shuts the loader processes down
    return out
