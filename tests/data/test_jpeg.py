"""The libjpeg-turbo fast path (`unison.data.jpeg`) gives the PIL path's crops bit for bit, EXIF orientation
included, and with DCT scaling where the crops allow it."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from unison.data import jpeg
from unison.data.augment import ViewAugmenter
from unison.data.catalog import open_catalog
from unison.data.decode import CropDecoder
from unison.data.files import orientation, upright_size

pytestmark = pytest.mark.skipif(not jpeg.available(), reason="simplejpeg is not installed")

_MEAN, _STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _photo(w: int, h: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: compresses like a photograph, not like flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], -1)
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    (root / "a").mkdir()
    (root / "b").mkdir()
    for k, (w, h) in enumerate([(375, 500), (500, 333), (300, 300), (1600, 1200), (2400, 1800), (450, 380)]):
        Image.fromarray(_photo(w, h, k)).save(root / "a" / f"{k}.jpg", quality=90)
    Image.fromarray(_photo(640, 480, 9)).save(root / "b" / "progressive.jpg", quality=85, progressive=True)
    Image.fromarray(_photo(400, 300, 10)).save(root / "b" / "444.jpg", quality=95, subsampling=0)
    Image.fromarray(_photo(900, 700, 11)[..., 0]).save(root / "b" / "grey.jpg", quality=90)
    for turn in (3, 6, 8):  # EXIF orientation: upside down, and the two sideways ones (sides swapped)
        exif = Image.Exif()
        exif[0x0112] = turn
        Image.fromarray(_photo(520, 360, 20 + turn)).save(root / "b" / f"turn{turn}.jpg", quality=90, exif=exif)
    Image.fromarray(_photo(350, 300, 30)).save(root / "b" / "png.png")  # stays on the PIL path
    return root


@pytest.mark.parametrize("preset,size", [("simclr", 96), ("multicrop", 64)])
def test_fast_path_equals_pil_path(folder, monkeypatch, preset, size):
    catalog = open_catalog(str(folder))
    aug = ViewAugmenter(preset, size, _MEAN, _STD)
    job = (1, list(range(len(catalog))))
    from unison.data.files import open_image

    assert sum(jpeg.handles(open_image(catalog.read(i))) for i in range(len(catalog))) == len(catalog) - 1  # not PNG
    fast = CropDecoder(catalog, aug, seed=3, on_corrupt="error")(job)
    assert fast["error"] is None
    monkeypatch.setattr(jpeg, "_sj", None)  # every image through PIL
    slow = CropDecoder(catalog, aug, seed=3, on_corrupt="error")(job)
    for a, b in zip(fast["crops"], slow["crops"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert bool((a == b).all())


def test_dct_scaling_is_used_and_exact(folder):
    """A large photograph with a whole-image box decodes at 1/8 through libjpeg, equal to PIL's draft."""
    data = (folder / "a" / "4.jpg").read_bytes()
    arr, s = jpeg.decode_scaled(data, 2400, 1800, reduce=9.0)
    assert s == 8 and arr.shape == (225, 300, 3)
    import io

    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (300, 225))
    assert bool((np.asarray(im.convert("RGB")) == arr).all())


def test_orientation_as_exif_transpose(folder):
    from PIL import ImageOps

    for turn in (3, 6, 8):
        im = Image.open(folder / "b" / f"turn{turn}.jpg")
        assert orientation(im) == turn
        assert upright_size(im) == ImageOps.exif_transpose(im).size
