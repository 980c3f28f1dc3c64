"""The default view size of a run's images, one rule for every path that needs it.

`default_view_size(catalog, where)`: when ``--image-size`` is not given, a folder, file list or tar shards trains
at the median shorter side of `SIZE_PROBES` evenly spaced images (their headers), at most
`MAX_DEFAULT_SIZE`; images of several sizes get a line saying what was chosen and why. The pre-flight's plan,
both data paths (`unison.data.source`), ``unison eval`` and ``unison embed`` all take it; the memory path holds
the images at `stored_size` (the median image's size), `default_image_size` is the rule for images of one size
(the built-in sets, images given in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unison.config.fields import count
from unison.config.limits import MIN_IMAGE_SIZE
from unison.errors import DataError

from .files import open_image, upright_size
from .samples import Catalog

__all__ = ["MAX_DEFAULT_SIZE", "SIZE_PROBES", "ViewSize", "default_image_size", "default_view_size", "first_size",
           "sampled_sizes", "size_or_none", "stored_size"]

SIZE_PROBES = 16
MAX_DEFAULT_SIZE = 224


def size_or_none(catalog: Catalog, i: int) -> tuple[int, int] | None:
    """(H, W) of sample i from its header, None if unreadable."""
    try:
        w, h = upright_size(open_image(catalog.read(i)))   # as shown (EXIF orientation)
        return h, w
    except Exception:
        return None


def default_image_size(height: int, width: int, where: str, read: str = "the first one read") -> int:
    """The view size of images of one size `height` x `width` when ``--image-size`` is not given: their shorter
    side, at most 224. A side below 8 px (a 4000 x 1 strip) is refused: taking the longer side instead would
    make 4000 x 4000 views, gigabytes for one batch. `read`: which images the size is of, for the message."""
    size = min(MAX_DEFAULT_SIZE, int(height), int(width))
    if size < MIN_IMAGE_SIZE:
        raise DataError(f"the images of {where} are {int(width)}x{int(height)} px ({read}), too small a "
                        f"side for a default view size; give --image-size N (at least {MIN_IMAGE_SIZE}): views are "
                        "resized to N x N")
    return size


@dataclass(frozen=True)
class ViewSize:
    """The default view size of listed data (`default_view_size`), and the line that says why when it is not
    simply the images' one size."""

    size: int
    note: str | None = None


def default_view_size(catalog: Catalog, where: str) -> ViewSize:
    """The view size of a folder, list or shards when ``--image-size`` is not given: the median shorter side of
    `SIZE_PROBES` evenly spaced images (read from their headers; unreadable ones left out), at most 224.

    Why a median of a sample: the first file in sort order is no better a guide than any other, and a folder of
    photos of many sizes trained at whatever sorted first (a 12 x 40 thumbnail: 12 px views); a sample spread over
    the folder is a few header reads. When the sampled images differ in size, `ViewSize.note` says what was chosen
    and why; the pre-flight, both data paths, ``unison eval`` and ``unison embed`` all take this one rule."""
    sizes = sampled_sizes(catalog)
    if len(set(sizes)) == 1:
        return ViewSize(default_image_size(*sizes[0], where, f"the {count(len(sizes), 'image')} read"))
    sides = sorted(min(h, w) for h, w in sizes)
    median = sides[len(sides) // 2]
    if median < MIN_IMAGE_SIZE:
        raise DataError(f"the images of {where} have a median shorter side of {median} px (of the {len(sides)} "
                        f"read, {sides[0]} to {sides[-1]} px), too small for a default view size; give --image-size "
                        f"N (at least {MIN_IMAGE_SIZE}): views are resized to N x N")
    chosen = min(MAX_DEFAULT_SIZE, median)
    capped = f", capped at {MAX_DEFAULT_SIZE}" if median > MAX_DEFAULT_SIZE else ""
    note = (f"the images of {where} differ in size (shorter sides {sides[0]} to {sides[-1]} px in the {len(sides)} "
            f"read): views are {chosen} px, their median shorter side{capped}; --image-size N sets another")
    return ViewSize(chosen, note)


def sampled_sizes(catalog: Catalog) -> list[tuple[int, int]]:
    """(H, W) of `SIZE_PROBES` evenly spaced images of `catalog` (all of a smaller one), from their headers,
    unreadable ones left out (none read: the first readable image's, or a `DataError`): what decides the data mode
    (`choose_mode`), the default view size (`default_view_size`) and the size the memory path stores the images at
    (`stored_size`)."""
    probes = np.linspace(0, len(catalog) - 1, min(len(catalog), SIZE_PROBES)).round().astype(np.int64)
    sizes = [hw for hw in (size_or_none(catalog, int(i)) for i in probes) if hw is not None]
    return sizes or [first_size(catalog)]


def stored_size(sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The (H, W) the memory path decodes every image to (`unison.data.memory.load_catalog`): that of the sampled
    image with the median shorter side (`sampled_sizes`), so that its views (`default_view_size`) are cut from
    images of about their size; images of one size: theirs."""
    return sorted(sizes, key=min)[len(sizes) // 2]


def first_size(catalog: Catalog) -> tuple[int, int]:
    """(H, W) of the first sample whose header reads."""
    for i in range(min(len(catalog), 100)):
        size = size_or_none(catalog, i)
        if size is not None:
            return size
    raise DataError(f"no readable images in {catalog.location} (the first {min(len(catalog), 100)} failed to open)")
