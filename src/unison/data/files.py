"""Reading what a data spec names, within stated limits: the one place each rule on data files lives.

Every layout (folders, file lists, tar shards) and every path (memory, stream, kNN, ``unison eval``)
reads through these, so a hostile or careless data set ends in one line naming the file, never a
hang, a traceback or memory exhaustion:

* `read_regular`: the bytes of a regular file, at most ``limit`` bytes. A FIFO, a device
  (``x.png -> /dev/zero``) or a socket is refused without reading it (opened non-blocking, so
  a FIFO does not hang); a file longer than the limit is refused before it is read.
* `check_regular`: the same refusal from a path's metadata (the listing and the pre-flight use
  it, before anything is read).
* `parse_label`: a class index from a file (``.cls`` member, file list): ASCII digits only
  (``str.isdigit`` also takes ``²``), below `MAX_CLASSES`.
* `open_image`: an image's header, refused above `MAX_PIXELS` (a PNG of a few kilobytes can
  claim 30000 x 30000 pixels): every decode path opens the header through it first.
* EXIF orientation (phone photos are stored sideways with a tag saying how to turn them): every
  decode path shows an image as `PIL.ImageOps.exif_transpose` would, through `upright_size` (the
  size as shown, from the header alone) and `upright` (the decoded pixels turned).
* `decode_reason`: why an image failed, as one short line (PIL's "cannot identify image file
  <_io.BytesIO object at 0x...>" becomes "not an image PIL can read").
* `is_shard_pattern`, `SHARD_SUFFIXES`: what names tar shards (a brace pattern, a ``.tar`` file), the rule the
  layouts' dispatcher (`unison.data.catalog`) reads a data spec by before any shard is opened (`unison.data.shards`).

Limits: an image file at most `MAX_IMAGE_BYTES` (256 MiB), a file list `MAX_LIST_BYTES` (1 GiB),
a label member `MAX_LABEL_BYTES`, class indices below `MAX_CLASSES` (100,000), images at most
`MAX_PIXELS` (PIL's own refusal threshold, 2 x ``Image.MAX_IMAGE_PIXELS``).

Example::

    data = read_regular("/data/cat/0001.jpg")          # OSError for a FIFO, a device or a file over the limit
    label = parse_label("7", "tar shard a.tar: member k/1.cls")
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from unison.config.fields import ascii_digits
from unison.errors import DataError

__all__ = ["COMPRESSED", "MAX_CLASSES", "MAX_IMAGE_BYTES", "MAX_LABEL_BYTES", "MAX_LIST_BYTES", "MAX_PIXELS",
           "SHARD_SUFFIXES", "check_regular", "decode_reason", "file_kind", "is_shard_pattern", "open_image",
           "orientation", "parse_label", "read_regular", "resolved", "upright", "upright_size"]

MAX_IMAGE_BYTES = 256 * 2**20
MAX_LIST_BYTES = 2**30
MAX_LABEL_BYTES = 64
MAX_CLASSES = 100_000
MAX_PIXELS = 178_956_970     # PIL raises DecompressionBombError above this (2 x Image.MAX_IMAGE_PIXELS)
COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
SHARD_SUFFIXES = (".tar", *COMPRESSED)
_ORIENTATION_TAG = 0x0112
# EXIF orientation -> the PIL transpose that shows the image upright (PIL.ImageOps.exif_transpose's table).
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}


def is_shard_pattern(spec: str) -> bool:
    """`spec` is a brace pattern to expand (``train-{0000..0146}.tar``): it has one, and names nothing that exists. A
    folder or file named so (``br{1..2}``) is what it is: the one rule of every reader of a data option."""
    return "{" in spec and ".." in spec and not os.path.lexists(os.path.expanduser(spec))


def resolved(path: str, what: str) -> Path:
    """`path` with ``~`` expanded and links resolved; DataError for a link loop or a name too long."""
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as e:  # Python 3.11 raises RuntimeError for a loop of links
        reason = getattr(e, "strerror", None) or str(e)
        raise DataError(f"{what} {path} cannot be resolved ({reason})") from None


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str, what: str) -> os.stat_result:
    """os.stat of `path` (links followed); DataError naming `what` when it is missing or not a regular file."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise DataError(f"{what} {path} cannot be read ({reason})") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{what} {path} is {file_kind(st.st_mode)}, not a regular file; remove it or replace it "
                        "with the file it stands for")
    return st


def read_regular(path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path`, at most `limit` (`MAX_IMAGE_BYTES`); OSError for anything else."""
    limit = MAX_IMAGE_BYTES if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # non-blocking: a FIFO
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{file_kind(st.st_mode)}, not a regular file", path)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, past the {limit:,}-byte limit", path)
        parts, total = [], 0
        while True:  # the file may grow after fstat: stop at the limit all the same
            part = os.read(fd, min(1 << 24, limit + 1 - total))
            if not part:
                break
            parts.append(part)
            total += len(part)
            if total > limit:
                raise OSError(errno.EFBIG, f"more than {limit:,} bytes, past the limit", path)
        return b"".join(parts)
    finally:
        os.close(fd)


def parse_label(text: str, where: str) -> int:
    """A class index: ASCII digits only, below `MAX_CLASSES`; DataError naming `where` (file and line/member)."""
    if not ascii_digits(text):
        raise DataError(f"{where}: label {text[:20]!r} is not a class index (ASCII digits 0-9)")
    if len(text) > 20 or int(text) >= MAX_CLASSES:  # 20 digits: int() of a million-digit label takes seconds
        shown = text if len(text) <= 20 else f"{text[:20]}... ({len(text)} digits)"
        raise DataError(f"{where}: label {shown} is past the largest class index unison takes "
                        f"({MAX_CLASSES - 1:,}); number the classes from 0")
    return int(text)


def open_image(data: bytes):
    """A lazily decoded PIL image (the header parsed, the pixels not yet); ValueError above `MAX_PIXELS`."""
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(data))
    w, h = im.size
    if w * h > MAX_PIXELS:
        raise ValueError(f"{w}x{h} is {w * h:,} pixels, past the {MAX_PIXELS:,}-pixel limit (a decompression bomb?)")
    return im


def orientation(im) -> int:
    """The EXIF orientation (1-8) of an opened image, from its header; 1 (as stored) when absent or unreadable."""
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:   # a corrupt EXIF block: shown as stored, as exif_transpose does
        return 1
    return value if isinstance(value, int) and value in _TRANSPOSE else 1


def upright_size(im) -> tuple[int, int]:
    """(width, height) of an opened image as shown, EXIF orientation applied (5-8 swap the sides)."""
    w, h = im.size
    return (h, w) if orientation(im) >= 5 else (w, h)


def upright(im, turn: int):
    """The decoded image `im` turned by EXIF orientation `turn` (`orientation` of its header, read before any
    draft or conversion: those may drop the EXIF block)."""
    from PIL import Image

    name = _TRANSPOSE.get(turn)
    return im.transpose(getattr(Image.Transpose, name)) if name else im


def decode_reason(e: BaseException) -> str:
    """Why an image could not be decoded, one line of at most 200 characters, without object addresses."""
    text = str(e)
    if "cannot identify image file" in text:   # PIL names the BytesIO it was given: "<_io.BytesIO object at 0x...>"
        return "not an image PIL can read (unknown format or corrupt header)"
    return f"{type(e).__name__}: {text}".splitlines()[0][:200] if text else type(e).__name__
