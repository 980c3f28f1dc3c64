"""JPEG crops through libjpeg-turbo directly (`simplejpeg`), and the crop + resize + flip of every decode path.

`CropDecoder` (`unison.data.decode`) hands a JPEG here when `handles` says so; every other image
(PNG, CMYK JPEGs, ...) is decoded by PIL. Both then go through `resize_views`, so a view depends
on the image's pixels and its boxes alone, never on which decoder read it:

* the decode is PIL's, bit for bit: PIL's JPEG plugin and simplejpeg are both libjpeg-turbo with
  the same settings (accurate integer IDCT, fancy upsampling), and the DCT scale is PIL's
  ``Image.draft`` rule (`decode._draft`: the largest of 1/8, 1/4, 1/2 that leaves every view's
  box at least its output size), asked of libjpeg as ``min_width = ceil(W / s)``, which it meets
  with exactly 1/s (tested against PIL's draft decode);
* `resize_views`: each box, mapped to the decoded image, rounded to whole pixels, resized with
  torch's antialiased bilinear filter on uint8 channels-last (the filter of PIL's resize, several
  times its speed: threaded, no PIL image; it takes whole-pixel regions only), flipped while copied into the batch;
* EXIF orientation: read from the header (`files.orientation`, no pixel decoded), the decoded
  array turned as ``PIL.ImageOps.exif_transpose`` (and `files.upright` on the PIL path) does
  before it is cropped; the caller draws the boxes on the size as shown (`files.upright_size`).

Why faster: PIL decodes through its incremental ``ImageFile.load`` (buffer by buffer, then a
copy into its own storage); simplejpeg decodes into one numpy array in one call, with neither the
buffer-by-buffer load nor the copy.

Example::

    im = open_image(data)                       # header only
    if handles(im):
        crop_into(im, boxes, [224, 224], crops, row)
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .files import orientation

__all__ = ["available", "crop_into", "decode_scaled", "handles", "resize_views"]

_SCALES = (8, 4, 2)
try:
    import simplejpeg as _sj
except ImportError:  # a dependency; without it (a hand-made environment) every image takes the PIL path
    _sj = None


def available() -> bool:
    """Whether libjpeg-turbo can be called directly (simplejpeg imports)."""
    return _sj is not None


def handles(im: Any) -> bool:
    """True for a lazily opened baseline or progressive YCbCr / grey JPEG read from memory (`files.open_image`)."""
    return (_sj is not None and im.format == "JPEG" and im.mode in ("RGB", "L")
            and isinstance(getattr(im, "fp", None), io.BytesIO))


def decode_scaled(data: bytes, W: int, H: int, reduce: float) -> tuple[np.ndarray, int]:
    """uint8 [ceil(H/s), ceil(W/s), 3] and s: the largest s in (8, 4, 2, 1) with s <= `reduce`, as `_draft`."""
    assert _sj is not None
    s = next((k for k in _SCALES if k <= reduce), 1)
    arr = _sj.decode_jpeg(data, colorspace="RGB", min_width=-(-W // s), min_height=-(-H // s))
    if arr.shape[:2] != (-(-H // s), -(-W // s)):
        raise RuntimeError(f"libjpeg decoded {arr.shape[1]}x{arr.shape[0]} for a {W}x{H} JPEG at 1/{s}")
    return arr, s


def crop_into(im: Any, boxes: list, sizes: list[int], crops: list[np.ndarray], row: int) -> None:
    """Write every view of one image into row `row` of `crops`: `boxes[v]` = ((x0, y0, x1, y1), flip) in the
    coordinates of the image as shown, `sizes[v]` the view size. Raises on a corrupt JPEG (the caller skips it)."""
    turn = orientation(im)
    W, H = im.size  # as stored: what libjpeg decodes
    reduce = min(min(b[2] - b[0], b[3] - b[1]) / s for (b, _), s in zip(boxes, sizes))
    arr, s = decode_scaled(im.fp.getvalue(), W, H, reduce)
    resize_views(_turn_array(arr, turn), s, boxes, sizes, crops, row)


def _turn_array(arr: np.ndarray, turn: int) -> np.ndarray:
    """`arr` [H, W, 3] as `upright` turns a PIL image (views; `resize_views` copies the box it reads)."""
    if turn in (5, 6, 7, 8):
        arr = arr.transpose(1, 0, 2)  # TRANSPOSE; then 6 = flip left-right, 8 = flip top-bottom, 7 = both
        return arr[::-1, ::-1] if turn == 7 else arr[:, ::-1] if turn == 6 else arr[::-1] if turn == 8 else arr
    return arr[:, ::-1] if turn == 2 else arr[::-1, ::-1] if turn == 3 else arr[::-1] if turn == 4 else arr


def resize_views(arr: np.ndarray, s: float, boxes: list, sizes: list[int], crops: list[np.ndarray], row: int) -> None:
    """Crop, resize and flip every view of one decoded RGB image `arr` [h, w, 3] (decoded at 1/s scale) into row
    `row` of `crops` (uint8 [n, size, size, 3] per view). Every decode path calls this, so the views depend on the
    pixels and the boxes alone.

    The box, mapped to the decoded image, is rounded to whole pixels (edges at floor(x + 0.5), at least one pixel);
    the resize is torch's antialiased bilinear on uint8 channels-last (PIL's filter, several times PIL's
    speed; torch resizes whole-pixel regions only, hence the rounding); the flip happens in the copy into the
    batch. Each output pixel is computed on its own, so the thread count changes nothing."""
    import torch
    import torch.nn.functional as F

    h, w = arr.shape[:2]
    image = torch.from_numpy(np.ascontiguousarray(arr) if arr.strides[1] < 0 or arr.strides[0] < 0 else arr)
    image = image.permute(2, 0, 1)[None]  # [1, 3, h, w] with channels-last strides
    for v, ((x0, y0, x1, y1), flip) in enumerate(boxes):
        ix0, iy0 = min(w - 1, max(0, int(x0 / s + 0.5))), min(h - 1, max(0, int(y0 / s + 0.5)))
        ix1, iy1 = max(ix0 + 1, min(w, int(x1 / s + 0.5))), max(iy0 + 1, min(h, int(y1 / s + 0.5)))
        box = image[..., iy0:iy1, ix0:ix1].contiguous(memory_format=torch.channels_last)
        out = F.interpolate(box, size=(sizes[v], sizes[v]), mode="bilinear", antialias=True, align_corners=False)
        hwc = out[0].permute(1, 2, 0).numpy()
        crops[v][row] = hwc[:, ::-1] if flip else hwc
