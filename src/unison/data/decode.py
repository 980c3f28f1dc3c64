"""CPU decoding for the streaming loader: each sample decoded once, at reduced size when its crops allow.

`CropDecoder` is what a loader worker process runs on one job, ``(epoch, sample indices)``:

1. read the encoded bytes (`Catalog.read`) and the image size from the header alone;
2. draw every view's random-resized-crop box on the ORIGINAL size with the augmenter's
   own draws (`ViewAugmenter.crop_fractions` of `sample_uniform(seed, epoch, index,
   stream=view)`), so the box of view v of sample i is a function of (seed, epoch, i)
   whatever the rank, the batch or the worker that decodes it;
3. JPEG: decode at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, PIL's ``Image.draft``)
   when every view's box keeps at least its output size in pixels at that scale; the box
   is mapped to the reduced image (pixel k covers original pixels [k*s, (k+1)*s));
   EXIF orientation is applied as `PIL.ImageOps.exif_transpose` does: the boxes are drawn on the
   size as shown (`upright_size`) and the decoded image is turned before it is cropped;
   YCbCr and grey JPEGs are decoded by libjpeg-turbo directly (`unison.data.jpeg`: the same
   pixels as PIL's decoder, bit for bit, faster: one call, no incremental load);
4. convert any mode to RGB (grayscale, CMYK, palette, alpha — dropped as torchvision's
   loader does —, 16-bit grey scaled to 8 bits) and resize each box, rounded to whole pixels
   of the decoded image, to its view size with an antialiased bilinear filter (PIL's, as
   torchvision's RandomResizedCrop on PIL images; computed by torch on uint8,
   `jpeg.resize_views`, the same for every decoder), flipping where the view's flip draw says so;
5. return uint8 ``[b, 3, s, s]`` per view, and each sample's (H, W) as shown, int64 ``[b, 2]`` under ``"sizes"``
   (the image the boxes were drawn on: `ViewAugmenter.view_geometry` locates the views in it). Colour jitter,
   grayscale, blur, solarisation and normalisation then run batched on the training device (`ViewAugmenter.finish`), with the
   same per-sample draws; when training on the CPU (``finish=True``) they run here, in the
   loader process, so that they use every loader core rather than one training process.

Unreadable samples (``on_corrupt="skip"``): the sample's pixels come from the next readable
sample in catalog order (at most 10 tried), cropped with the *unreadable* sample's draws,
so batch sizes, the global order and every other sample's views are unchanged; the file
is reported once. ``on_corrupt="error"``: the job returns the file and the reason, and the
training process raises a one-line `DataError` naming it.

`decode_centre(data, size)`: the evaluation view (shorter side resized to ``size``,
centre square, EXIF orientation applied), used for every kNN set (training in either data mode,
``unison eval``, ``unison embed``) and the channel statistics of streamed data.

Example::

    dec = CropDecoder(catalog, augmenter, seed=0, on_corrupt="skip")
    out = dec((3, [17, 4, 99]))          # out["crops"][v]: uint8 [3, 3, s_v, s_v]
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from unison.errors import DataError

from . import jpeg
from .augment import ViewAugmenter
from .files import decode_reason, open_image, orientation, upright, upright_size  # open_image: the header, refused past

# MAX_PIXELS (the decompression-bomb limit)
from .samples import Catalog

__all__ = ["CropDecoder", "decode_centre", "open_image", "to_rgb"]

_MAX_SUBSTITUTES = 10
_DRAFT_SCALES = (8, 4, 2)


def to_rgb(im):
    """Any PIL mode as 8-bit RGB: 16-bit grey is scaled (>> 8), alpha is dropped as in torchvision's loader."""
    from PIL import Image

    if im.mode == "RGB":
        return im
    if im.mode.startswith("I;16") or im.mode in ("I", "F"):
        arr = np.asarray(im, dtype=np.float64 if im.mode == "F" else np.int64)
        top = 1.0 if im.mode == "F" else 65535
        im = Image.fromarray(np.clip(arr * (255 / top), 0, 255).round().astype(np.uint8), "L")
    with warnings.catch_warnings():  # palette + transparency: PIL suggests RGBA; RGB is what we want
        warnings.simplefilter("ignore", UserWarning)
        return im.convert("RGB")


def _draft(im, W: int, H: int, reduce: float) -> float:
    """Ask a JPEG for a DCT-scaled decode by a power of two <= `reduce`; return the scale it will use."""
    if im.format != "JPEG" or reduce < 2:
        return 1.0
    s = next(k for k in _DRAFT_SCALES + (1,) if k <= reduce)
    im.draft("RGB", (max(1, W // s), max(1, H // s)))
    w2, h2 = im.size
    for k in (8, 4, 2, 1):  # the scale PIL chose, from the reduced size (ceil(W / k))
        if -(-W // k) == w2 and -(-H // k) == h2:
            return float(k)
    raise RuntimeError(f"unexpected draft size {w2}x{h2} of a {W}x{H} JPEG")


def decode_centre(data: bytes, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the shorter side resized to `size` (antialiased), the centre square."""
    from PIL import Image

    im = open_image(data)
    turn = orientation(im)   # read before the draft: the shown image's centre square is cut
    W, H = im.size
    side = min(W, H)
    s = _draft(im, W, H, side / size)
    Wu, Hu = (H, W) if turn >= 5 else (W, H)   # the shown size
    box = ((Wu - side) / 2 / s, (Hu - side) / 2 / s, (Wu + side) / 2 / s, (Hu + side) / 2 / s)
    out = upright(to_rgb(im), turn).resize((size, size), Image.Resampling.BILINEAR, box=box)
    return np.asarray(out, dtype=np.uint8)


class CropDecoder:
    """Decode and crop the views of one job of samples (see the module docstring); picklable."""

    def __init__(self, catalog: Catalog, augment: ViewAugmenter, seed: int, on_corrupt: str,
                 positions: np.ndarray | None = None, finish: bool = False):
        self.catalog, self.augment, self.seed, self.on_corrupt = catalog, augment, seed, on_corrupt
        self.finish = finish  # also run the colour ops here (CPU training: in parallel over the loader processes)
        self.positions = positions  # sample index -> catalog index (a subset), or None: the identity
        self.n = len(positions) if positions is not None else len(catalog)

    def catalog_index(self, i: int) -> int:
        return int(self.positions[i]) if self.positions is not None else i

    def __call__(self, job: tuple[int, list[int]]) -> dict[str, Any]:
        epoch, indices = job
        idx = torch.as_tensor(indices, dtype=torch.int64)
        images: list[Any] = []
        skipped: list[tuple[str, str]] = []
        for i in indices:
            im, _, _ = self._readable(i, skipped, start=0)
            if im is None:
                return {"epoch": epoch, "indices": idx, "crops": [], "skipped": [], "error": skipped[-1]}
            images.append(im)
        # Boxes of every view, drawn on each image's original size: one vectorised call per view.
        shown = [upright_size(im) for im in images]   # boxes are drawn on the image as shown (EXIF orientation)
        sizes = torch.tensor([[h, w] for w, h in shown], dtype=torch.int64)
        H = torch.tensor([[h] for _, h in shown], dtype=torch.float64)
        W = torch.tensor([[w] for w, _ in shown], dtype=torch.float64)
        geometry = [self.augment.crop_fractions(self.augment.uniforms(idx, epoch, self.seed, v), v, H, W)
                    for v in range(self.augment.num_views)]
        crops = [np.empty((len(indices), s, s, 3), dtype=np.uint8) for s in self.augment.view_sizes]
        for k, i in enumerate(indices):
            boxes = [self._box(g, k, float(W[k, 0]), float(H[k, 0])) for g in geometry]
            try:
                self._crop_into(images[k], boxes, crops, k)
            except Exception as e:  # the header read, the pixel data did not (a truncated file)
                skipped.append((self._describe(i), _reason(e)))
                if self.on_corrupt == "error" or not self._substitute(i, epoch, crops, k, skipped, sizes):
                    return {"epoch": epoch, "indices": idx, "crops": [], "skipped": [], "error": skipped[-1]}
        out = [torch.from_numpy(c).permute(0, 3, 1, 2).contiguous() for c in crops]
        if self.finish:
            return {"epoch": epoch, "indices": idx, "skipped": skipped, "error": None, "sizes": sizes,
                    "views": self.augment.finish(out, idx, epoch, self.seed)}
        return {"epoch": epoch, "indices": idx, "skipped": skipped, "error": None, "crops": out, "sizes": sizes}

    # -- one sample -----------------------------------------------------------------------------------
    def _describe(self, i: int) -> str:
        return self.catalog.describe(self.catalog_index(i))

    def _readable(self, i: int, skipped: list, start: int):
        """(image with its header read, k, bytes) of the first readable sample i + k, k >= start; (None, k, b"")
        when there is none within the limit, or on_corrupt='error' (the reason is the last entry of `skipped`)."""
        first = ""
        for k in range(start, _MAX_SUBSTITUTES + 1):
            j = (i + k) % self.n
            try:
                data = self.catalog.read(self.catalog_index(j))
                return open_image(data), k, data
            except DataError as e:  # the data set itself is broken (a shard changed since it was indexed)
                skipped.append((self._describe(j), str(e)))
                return None, k, b""
            except Exception as e:
                skipped.append((self._describe(j), _reason(e)))
                first = first or _reason(e)
                if self.on_corrupt == "error":
                    return None, k, b""
        skipped.append((self._describe(i), f"it and the {_MAX_SUBSTITUTES} samples after it are unreadable, "
                                           f"{_MAX_SUBSTITUTES + 1} in a row: {first}"))
        return None, _MAX_SUBSTITUTES, b""

    def _substitute(self, i: int, epoch: int, crops: list[np.ndarray], row: int, skipped: list,
                    sizes: torch.Tensor) -> bool:
        """Fill row `row` with the next readable sample's pixels, cropped with sample i's draws (its size in row
        `row` of `sizes`)."""
        idx = torch.tensor([i], dtype=torch.int64)
        start = 1
        while start <= _MAX_SUBSTITUTES:
            im, k, _ = self._readable(i, skipped, start)
            if im is None:
                return False
            W, H = upright_size(im)
            boxes = [self._box(self.augment.crop_fractions(self.augment.uniforms(idx, epoch, self.seed, v), v,
                                                           float(H), float(W)), 0, float(W), float(H))
                     for v in range(self.augment.num_views)]
            try:
                self._crop_into(im, boxes, crops, row)
                sizes[row] = torch.tensor([H, W])
                return True
            except Exception as e:
                skipped.append((self._describe((i + k) % self.n), _reason(e)))
                start = k + 1
        return False

    @staticmethod
    def _box(geometry: tuple[torch.Tensor, ...], k: int, W: float, H: float) -> tuple[tuple[float, ...], bool]:
        bw, bh, cx, cy, flip = (float(t[k]) for t in geometry)
        return ((cx - bw / 2) * W, (cy - bh / 2) * H, (cx + bw / 2) * W, (cy + bh / 2) * H), bool(flip)

    def _crop_into(self, im, boxes: list, crops: list[np.ndarray], row: int) -> None:
        if jpeg.handles(im):  # libjpeg-turbo called directly: the same pixels, faster (unison.data.jpeg)
            return jpeg.crop_into(im, boxes, self.augment.view_sizes, crops, row)
        turn = orientation(im)   # before the draft, which may drop the EXIF block
        W, H = im.size
        # The largest DCT scale that leaves every view's box at least its output size in both directions.
        reduce = min(min(b[2] - b[0], b[3] - b[1]) / s for (b, _), s in zip(boxes, self.augment.view_sizes))
        s = _draft(im, W, H, reduce)
        rgb = upright(to_rgb(im), turn)   # boxes are in the shown image's coordinates
        jpeg.resize_views(np.array(rgb, dtype=np.uint8), s, boxes, self.augment.view_sizes, crops, row)


_reason = decode_reason


def unreadable_error(where: str, why: str, on_corrupt: str) -> DataError:
    """The one line for a sample of a batch that cannot be read (`where`, `why`), as the ``--on-corrupt`` policy in
    effect leaves it: ``error`` names the option that skips it; ``skip`` found no readable sample to take its place
    (a run of unreadable ones, a shard that changed): files changed since the run listed them."""
    if on_corrupt == "error":
        return DataError(f"cannot read image {where} ({why}); fix or remove it, or pass --on-corrupt skip")
    return DataError(f"cannot read image {where} ({why}), and --on-corrupt skip (in effect) found no readable sample "
                     "to take its place: the data may have changed since the run listed it (files deleted, moved or "
                     "rewritten while it ran); restore them, or start the run again on the data as it is now")
