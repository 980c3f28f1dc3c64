"""EXIF orientation (issue 22, item 8): a phone photo stored sideways with an orientation tag is shown upright, as
`PIL.ImageOps.exif_transpose` shows it, on every decode path: in memory, the streamed crops (folder and shards),
the GPU path's decoder (run on the CPU here), and the kNN / ``unison eval`` / ``unison embed`` view."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from unison.data.catalog import open_catalog
from unison.data.decode import CropDecoder, decode_centre
from unison.data.generated import write_shards
from unison.data.memory import decode_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
W, H = 40, 24   # as stored; shown 24 wide and 40 high (orientation 6: turned 90 degrees clockwise)


def _photo(orientation: int) -> bytes:
    """A JPEG stored W x H with four coloured quadrants and an EXIF orientation tag."""
    arr = np.zeros((H, W, 3), np.uint8)
    arr[:H // 2, :W // 2] = (250, 10, 10)
    arr[:H // 2, W // 2:] = (10, 250, 10)
    arr[H // 2:, :W // 2] = (10, 10, 250)
    arr[H // 2:, W // 2:] = (250, 250, 10)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def _shown(data: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    """The tagged photo as a folder and as a shard, and its upright pixels as a PNG (no tag) beside them."""
    tmp = tmp_path_factory.mktemp("exif")
    data = _photo(6)
    (tmp / "tagged" / "c").mkdir(parents=True)
    (tmp / "tagged" / "c" / "a.jpg").write_bytes(data)
    (tmp / "upright" / "c").mkdir(parents=True)
    Image.fromarray(_shown(data)).save(tmp / "upright" / "c" / "a.png")
    write_shards(tmp / "tagged", ["c/a.jpg"], tmp / "shards")
    return {"tagged": tmp / "tagged", "upright": tmp / "upright", "shards": tmp / "shards", "data": tmp / "tagged" / "c" / "a.jpg"}


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_memory_path_shows_the_photo_upright(orientation):
    data = _photo(orientation)
    assert np.array_equal(decode_bytes(data).permute(1, 2, 0).numpy(), _shown(data))


def test_knn_and_eval_view_is_the_upright_centre_square(photos):
    data = photos["data"].read_bytes()
    shown = Image.fromarray(_shown(data))          # 24 wide, 40 high: the centre square is rows 8..32
    want = np.asarray(shown.resize((24, 24), Image.Resampling.BILINEAR, box=(0, 8, 24, 32)))
    assert shown.size == (H, W) and np.array_equal(decode_centre(data, 24), want)


@pytest.mark.parametrize("layout", ["tagged", "shards"])
def test_streamed_crops_are_those_of_the_upright_photo(photos, layout):
    """Folder and shards: the crops of the tagged JPEG are the crops of its upright pixels (same draws, boxes on
    the shown size)."""
    from helpers.data_stream import _augmenter

    def crops(where: Path) -> list[torch.Tensor]:
        return CropDecoder(open_catalog(str(where)), _augmenter(), 7, "skip")((0, [0]))["crops"]

    got, want = crops(photos[layout]), crops(photos["upright"])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_gpu_path_decoder_turns_the_photo_too(photos):
    from helpers.data_stream import _augmenter

    from unison.data.gpu_decode import GpuCropper

    data = photos["data"].read_bytes()
    img = GpuCropper(_augmenter(), 7, torch.device("cpu")).decode([torch.frombuffer(bytearray(data), dtype=torch.uint8)])[0]
    shown = torch.from_numpy(_shown(data).copy()).permute(2, 0, 1)
    assert img.shape == shown.shape == (3, W, H)
    assert (img.float() - shown.float()).abs().mean() < 3   # another JPEG decoder: not bit-equal
