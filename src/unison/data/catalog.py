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

The `Catalog` value itself (packed names, shard offsets, reads) is `unison.data.samples`; this
module is the dispatcher over the layouts, with the folder and file-list ones; tar shards are
`unison.data.shards`.

Example::

    cat = open_catalog("/data/imagenet/train")     # ImageFolder: 1,281,167 samples, 1000 classes
    data = cat.read(17)                            # the encoded bytes of sample 17
    print(cat.describe(17), cat.classes[cat.labels[17]])
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from unison.errors import DataError

from .samples import IMG_EXTENSIONS, Catalog, PackedStrings, label_indices, stat_all
from .shards import SHARD_SUFFIXES, open_shards, shard_paths

__all__ = ["IMG_EXTENSIONS", "Catalog", "PackedStrings", "open_catalog", "scan_folder"]

LAYOUTS = "an ImageFolder layout {}/<class>/<image>, a folder of images, a file list or .tar shards"


def open_catalog(spec: str) -> Catalog:
    """The catalog of an ImageFolder, a flat folder of images, a file list or tar shards (see the module docstring).

    Raises `DataError` with a one-line message that names the path and says what was expected.
    """
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
    missing = next((k for k, st in enumerate(stat_all([os.path.join(base, n) for n in names], missing_ok=True))
                    if st is None), None)
    if missing is not None:
        raise DataError(f"file list {path}: line {line_of[missing]}: {os.path.join(base, names[missing])} "
                        "does not exist")
    labels, classes = label_indices(raw_labels) if all(has) else (np.full(len(names), -1, np.int64), [])
    return Catalog("list", path, base, PackedStrings(names), labels, classes)

