"""The samples of a data spec as one `Catalog`: where each sample's bytes are, its label, and how to read them.

This is the value every layout produces (`unison.data.catalog` for folders and file lists,
`unison.data.shards` for tar shards, `unison.data.pack` for packs) and every reader consumes (`unison.data.memory`,
`unison.data.decode`, `unison.data.stream`); it sits below them so that none of them imports another
to reach it. Also here: the helpers the layouts share (image extensions, class indices from
labels, stat of many files at once).

Memory: names are packed into one byte buffer with an offset array (about 8 bytes + the name
per sample), shared copy-on-write with the loader
worker processes, which Python string lists would not be: their reference counts dirty
every page).

Example::

    cat = open_catalog("/data/imagenet/train")     # a Catalog: 1,281,167 samples, 1000 classes
    data = cat.read(17)                            # the encoded bytes of sample 17
    print(cat.describe(17), cat.classes[cat.labels[17]])
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unison.config.fields import ascii_digits, shown
from unison.distributed.watchdog import reading
from unison.errors import DataError

from .files import MAX_CLASSES, MAX_IMAGE_BYTES, parse_label, read_regular

__all__ = ["IMG_EXTENSIONS", "Catalog", "PackedStrings", "integer_classes", "label_indices", "stat_all"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
_MAX_OPEN_SHARDS = 64
POSITIONED = ("shards", "pack")   # kinds whose samples are (file, offset, size) in a few large files


class PackedStrings:
    """An immutable list of strings in one uint8 buffer plus offsets (no per-string Python objects)."""

    def __init__(self, strings: list[str]):
        encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self.offsets[1:])
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def tolist(self) -> list[str]:
        return [self[i] for i in range(len(self))]


@dataclass
class Catalog:
    """The samples of one data spec; see the module docstring."""

    kind: str                        # "folder" | "flat" | "list" | "shards" | "pack"
    location: Path                   # the folder, the list file, or the first shard
    base: Path                       # what relative file names are joined to
    names: PackedStrings             # file path relative to `base`, or member name in its shard
    labels: np.ndarray               # int64 [N]; -1 = no label
    classes: list[str]               # [] when unlabelled
    shards: list[str] = field(default_factory=list)                             # "shards"/"pack": the files
    shard_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # [N] shard of each sample
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # [N] data offset in the shard
    sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))     # [N] data size in bytes

    def __post_init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.names)

    def __getstate__(self) -> dict[str, Any]:  # open file descriptors stay in their process
        return {k: v for k, v in self.__dict__.items() if k not in ("_fds", "_pid")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def labelled(self) -> bool:
        return bool(self.classes)

    @property
    def display_name(self) -> str:
        loc = self.location if self.kind != "shards" else Path(self.shards[0]).parent
        return f"{loc.parent.name}/{loc.name}"

    def path(self, i: int) -> str:
        """The file of sample i (for shards: the shard)."""
        if self.kind in POSITIONED:
            return self.shards[int(self.shard_of[i])]
        return os.path.join(self.base, self.names[i])

    def describe(self, i: int) -> str:
        """Sample i for messages: its file, or ``shard.tar:member``."""
        return f"{self.path(i)}:{self.names[i]}" if self.kind in POSITIONED else self.path(i)

    def read(self, i: int) -> bytes:
        """The encoded bytes of sample i (a file read, or one positioned read from its shard or pack), under the
        run's watchdog (`reading`: a read that never returns ends the run, whatever it was read for)."""
        with reading():
            return self._read(i)

    def _read(self, i: int) -> bytes:
        if self.kind not in POSITIONED:
            return read_regular(self.path(i))  # a FIFO, a device or an oversized file: OSError, nothing read
        size, offset = int(self.sizes[i]), int(self.offsets[i])
        if size > MAX_IMAGE_BYTES:  # the bound of every image read, as for files
            raise OSError(errno.EFBIG, f"member {self.names[i]} is {size:,} bytes, past the {MAX_IMAGE_BYTES:,}-byte "
                          "limit", self.path(i))
        data = os.pread(self._shard_fd(int(self.shard_of[i])), size, offset)
        if len(data) != size:
            what = "tar shard" if self.kind == "shards" else "pack"
            raise DataError(f"{what} {self.path(i)} is truncated: member {self.names[i]} ends at byte "
                            f"{offset + size}, beyond the end of the file")
        return data

    def _shard_fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked loader worker: open its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            if len(self._fds) >= _MAX_OPEN_SHARDS:  # bounded: 1024 shards must not mean 1024 descriptors
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[shard] = os.open(self.shards[shard], os.O_RDONLY)
        return fd

    def file_stats(self) -> list[tuple[int, int]]:
        """(size, mtime_ns) of every file (samples, or shards), for cache keys."""
        files = self.shards if self.kind in POSITIONED else [self.path(i) for i in range(len(self))]
        return [(st.st_size, st.st_mtime_ns) for st in stat_all(files) if st is not None]  # missing: raised


def label_indices(text: list[str], where: Callable[[int], str]) -> tuple[np.ndarray, list[str]]:
    """Class indices and class names: integers (ASCII digits) stand for themselves, names are sorted.

    `where(k)` names label k in messages (file and line): an integer label past `MAX_CLASSES` is an error.
    """
    odd = next((k for k, t in enumerate(text) if t.isdigit() and not t.isascii()), None)
    if odd is not None:  # '²' or '٣': a number to a reader, neither an index nor a plain name here
        parse_label(text[odd], where(odd))
    if all(ascii_digits(t) for t in text):
        values = np.asarray([parse_label(t, where(k)) for k, t in enumerate(text)], dtype=np.int64)
        return values, integer_classes(values)
    classes = sorted(set(text))
    index = {c: k for k, c in enumerate(classes)}
    return np.asarray([index[t] for t in text], dtype=np.int64), classes


def integer_classes(values: np.ndarray) -> list[str]:
    """The classes ``"0"`` .. ``str(max)`` of integer labels (checked below `MAX_CLASSES` where they were read)."""
    top = int(values.max()) if len(values) else -1
    if top >= MAX_CLASSES:  # an index cached by an older version: refuse rather than allocate
        raise DataError(f"label {top} is past the largest class index unison takes ({MAX_CLASSES - 1:,})")
    return [str(k) for k in range(top + 1)]


def _missing(path: str) -> str:
    """Why a listed file cannot be found: a link to nothing (listed as it is), or a file removed since."""
    if os.path.islink(path):
        try:
            target = shown(os.readlink(path))
        except OSError:
            target = "an unreadable target"
        return f"data file {path} is a broken link (to {target}, which does not exist); remove it or fix the link"
    return f"{path} does not exist (it was there when the data was listed)"


def stat_all(paths: list[str], missing_ok: bool = False) -> list[os.stat_result | None]:
    """os.stat of every path, in a thread pool (stat releases the GIL; network file systems need the overlap)."""
    def one(p: str) -> os.stat_result | None:
        try:
            return os.stat(p)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise DataError(_missing(p)) from None

    if len(paths) < 256:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, paths, chunksize=256))
