"""What a data spec holds: one `Catalog` of samples (where each one's bytes are, and its label).

`open_catalog(spec)` recognises four layouts:

==================  ==========================================================  ===========
layout              what ``spec`` is                                            labels
==================  ==========================================================  ===========
ImageFolder         a folder of class subfolders ``<dir>/<class>/.../<image>``  the class
flat folder         a folder of images without subfolders (as Lightly reads)    none
file list           a text file, one image path per line (relative paths are    optional
                    relative to the list's folder); an optional label after a
                    tab, or after whitespace when the paths have no spaces;
                    blank lines and lines starting with ``#`` are skipped
tar shards          ``x.tar``, a folder of ``*.tar`` or a brace pattern          ``.cls``
                    ``train-{0000..0146}.tar`` (WebDataset layout, see shards)
==================  ==========================================================  ===========

Samples are numbered in a fixed order: ImageFolder by class then sorted path (as
torchvision), a flat folder by sorted name, a list by line, shards by shard then member.
That number is the *sample index* every random draw is keyed on, so the same images in
the same order give the same views whatever the layout (tested).

Labels of a file list: when every label is a non-negative integer, class k is ``str(k)``;
otherwise the classes are the sorted distinct names. A list with labels on some lines only
is an error naming the line. A catalog without labels has ``classes == []``: SSL pre-training
needs none, and kNN evaluation is then skipped.

Memory: names are packed into one byte buffer with an offset array (about 8 bytes + the name
per sample; ImageNet-1k's 1.28M paths take ~80 MB, shared copy-on-write with the loader
worker processes, which Python string lists would not be: their reference counts dirty
every page).

Example::

    cat = open_catalog("/data/imagenet/train")     # ImageFolder: 1,281,167 samples, 1000 classes
    data = cat.read(17)                            # the encoded bytes of sample 17
    print(cat.describe(17), cat.classes[cat.labels[17]])
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unison.errors import DataError

__all__ = ["IMG_EXTENSIONS", "Catalog", "PackedStrings", "open_catalog", "scan_folder"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
LAYOUTS = "an ImageFolder layout {}/<class>/<image>, a folder of images, a file list or .tar shards"
_MAX_OPEN_SHARDS = 64


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

    kind: str                        # "folder" | "flat" | "list" | "shards"
    location: Path                   # the folder, the list file, or the first shard
    base: Path                       # what relative file names are joined to
    names: PackedStrings             # file path relative to `base`, or member name in its shard
    labels: np.ndarray               # int64 [N]; -1 = no label
    classes: list[str]               # [] when unlabelled
    shards: list[str] = field(default_factory=list)                             # kind "shards": the tar files
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
        if self.kind == "shards":
            return self.shards[int(self.shard_of[i])]
        return os.path.join(self.base, self.names[i])

    def describe(self, i: int) -> str:
        """Sample i for messages: its file, or ``shard.tar:member``."""
        return f"{self.path(i)}:{self.names[i]}" if self.kind == "shards" else self.path(i)

    def read(self, i: int) -> bytes:
        """The encoded bytes of sample i (a file read, or one positioned read from its shard)."""
        if self.kind != "shards":
            with open(self.path(i), "rb") as f:
                return f.read()
        size, offset = int(self.sizes[i]), int(self.offsets[i])
        data = os.pread(self._shard_fd(int(self.shard_of[i])), size, offset)
        if len(data) != size:
            raise DataError(f"tar shard {self.path(i)} is truncated: member {self.names[i]} ends at byte "
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
        files = self.shards if self.kind == "shards" else [self.path(i) for i in range(len(self))]
        return [(st.st_size, st.st_mtime_ns) for st in _stat_all(files) if st is not None]  # missing: raised


def open_catalog(spec: str) -> Catalog:
    """The catalog of an ImageFolder, a flat folder of images, a file list or tar shards (see the module docstring).

    Raises `DataError` with a one-line message that names the path and says what was expected.
    """
    from .shards import SHARD_SUFFIXES, open_shards, shard_paths

    if "{" in spec and ".." in spec:
        return open_shards(shard_paths(spec))
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise DataError(f"data folder {path} does not exist (expected {LAYOUTS.format(path)}, or the name 'digits' "
                        "or 'cifar10')")
    if path.is_file():
        if path.name.endswith(SHARD_SUFFIXES):
            return open_shards(shard_paths(str(path)))
        return _open_list(path)
    entries = [e for e in os.scandir(path) if not e.name.startswith(".")]
    if not entries:
        raise DataError(f"data folder {path} is empty (expected {LAYOUTS.format(path)})")
    if any(e.is_dir() for e in entries):
        return _open_image_folder(path)
    if any(e.name.endswith(SHARD_SUFFIXES) for e in entries):
        return open_shards(shard_paths(str(path)))
    names = sorted(e.name for e in entries if e.name.lower().endswith(IMG_EXTENSIONS))
    if not names:
        exts = ", ".join(IMG_EXTENSIONS[:3])
        raise DataError(f"no image files ({exts}, ...) in {path} (expected {LAYOUTS.format(path)})")
    return Catalog("flat", path, path, PackedStrings(names), np.full(len(names), -1, np.int64), [])


def scan_folder(root: Path) -> list[str]:
    """The sorted relative image paths of an ImageFolder tree (raises `DataError` for a bad layout)."""
    return _scan_image_folder(root)[1]


def _scan_image_folder(root: Path) -> tuple[list[str], list[str], list[int]]:
    """Classes, sorted relative file paths and labels of an ImageFolder tree (nested folders searched)."""
    layout = f"expected an ImageFolder layout {root}/<class>/<image>"
    if not root.exists():
        raise DataError(f"data folder {root} does not exist ({layout}, or the name 'digits' or 'cifar10')")
    if not root.is_dir():
        raise DataError(f"data path {root} is not a folder ({layout})")
    entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
    classes = sorted(e.name for e in entries if e.is_dir())
    if not entries:
        raise DataError(f"data folder {root} is empty ({layout})")
    if not classes:
        raise DataError(f"data folder {root} has no class subfolders ({layout})")
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        found = []
        for dirpath, dirnames, names in os.walk(root / cls, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, root)  # once per directory, not per file
            found += [os.path.join(rel_dir, n) for n in names if n.lower().endswith(IMG_EXTENSIONS)]
        found.sort()
        files += found
        labels += [label] * len(found)
    if not files:
        exts = ", ".join(IMG_EXTENSIONS[:3])
        raise DataError(f"no image files ({exts}, ...) in the class subfolders of {root} ({layout})")
    empty = sorted(set(classes) - {classes[i] for i in set(labels)})
    if empty:
        warnings.warn(f"{root}: class folder(s) without images kept as classes: {empty[:5]}", stacklevel=4)
    return classes, files, labels


def _open_image_folder(root: Path) -> Catalog:
    classes, files, labels = _scan_image_folder(root)
    return Catalog("folder", root, root, PackedStrings(files), np.asarray(labels, dtype=np.int64), classes)


def _open_list(path: Path) -> Catalog:
    """A file list: ``path`` or ``path<TAB>label`` (or ``path label`` for paths without spaces) per line."""
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        raise DataError(f"cannot read the file list {path} ({e.strerror or e})") from None
    if "\x00" in text[:4096]:
        raise DataError(f"{path} is neither a folder, a text file list (one image path per line) nor a .tar shard")
    names: list[str] = []
    label: str | None
    raw_labels: list[str | None] = []
    line_of: list[int] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "\t" in line:
            name, label = (s.strip() for s in line.rsplit("\t", 1))
        else:
            parts = line.rsplit(None, 1)
            name, label = (parts[0], parts[1]) if len(parts) == 2 else (line, None)
        names.append(name)
        raw_labels.append(label or None)
        line_of.append(lineno)
    if not names:
        raise DataError(f"file list {path} names no images (expected one image path per line)")
    has = [lab is not None for lab in raw_labels]
    if any(has) and not all(has):
        first = line_of[has.index(not has[0])]
        raise DataError(f"file list {path}: line {first} {'has no' if has[0] else 'has a'} label column, unlike "
                        f"line {line_of[0]}; give a label on every line or on none (paths with spaces: tab-separate)")
    base = path.parent
    missing = next((k for k, st in enumerate(_stat_all([os.path.join(base, n) for n in names], missing_ok=True))
                    if st is None), None)
    if missing is not None:
        raise DataError(f"file list {path}: line {line_of[missing]}: {os.path.join(base, names[missing])} "
                        "does not exist")
    labels, classes = _label_indices(raw_labels) if all(has) else (np.full(len(names), -1, np.int64), [])
    return Catalog("list", path, base, PackedStrings(names), labels, classes)


def _label_indices(raw: list[Any]) -> tuple[np.ndarray, list[str]]:
    """Class indices and class names: integers stand for themselves, names are sorted."""
    text = [str(r) for r in raw]
    if all(t.isdigit() for t in text):
        values = np.asarray([int(t) for t in text], dtype=np.int64)
        return values, [str(k) for k in range(int(values.max()) + 1)]
    classes = sorted(set(text))
    index = {c: k for k, c in enumerate(classes)}
    return np.asarray([index[t] for t in text], dtype=np.int64), classes


def _stat_all(paths: list[str], missing_ok: bool = False) -> list[os.stat_result | None]:
    """os.stat of every path, in a thread pool (stat releases the GIL; network file systems need the overlap)."""
    def one(p: str) -> os.stat_result | None:
        try:
            return os.stat(p)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise DataError(f"{p} does not exist (it was there when the data was listed)") from None

    if len(paths) < 256:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, paths, chunksize=256))
