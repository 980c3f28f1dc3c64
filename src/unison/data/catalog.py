"""What a data spec holds: one `Catalog` of samples (where each one's bytes are, and its label).

`open_catalog(spec)` recognises five layouts:

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
pack                ``x.pack``: images back to back in one file, plus an index   its index
                    (`unison.data.pack`)
==================  ==========================================================  ===========

A folder holding both images and subfolders is neither layout and is refused by name (reading it
as an ImageFolder would drop its top-level images). Folder walks follow links to folders once per
real folder (a loop such as ``a/up -> ..`` or a link into the data folder itself adds nothing), so
each image is counted once. A name ending in an image extension that is a FIFO, a device or a
socket is refused when the data is listed (by the pre-flight, before any worker starts); so is a
file list naming one. File lists are UTF-8 (a byte-order mark is dropped); a line holding a control
character (NUL...), a path past the file system's lengths or a label past
`unison.data.files.MAX_CLASSES` is refused naming the line. The reading limits themselves are
`unison.data.files`.

Samples are numbered in a fixed order: ImageFolder by class then sorted path (as
torchvision), a flat folder by sorted name, a list by line, shards by shard then member.
That number is the *sample index* every random draw is keyed on, so the same images in
the same order give the same views whatever the layout (tested).

Labels of a file list: when every label is a non-negative integer (ASCII digits), class k is ``str(k)``;
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
import stat
import warnings
from pathlib import Path

import numpy as np

from unison.errors import DataError

from .files import MAX_LIST_BYTES, SHARD_SUFFIXES, check_regular, file_kind, is_shard_pattern, read_regular, resolved
from .pack import PACK_SUFFIX, open_pack
from .samples import IMG_EXTENSIONS, Catalog, PackedStrings, label_indices, stat_all

__all__ = ["IMG_EXTENSIONS", "Catalog", "PackedStrings", "open_catalog", "scan_folder"]

_PATH_MAX, _NAME_MAX = 4096, 255   # Linux's limits on a path and on one name in it (bytes)
LAYOUTS = "an ImageFolder layout {}/<class>/<image>, a folder of images, a file list, .tar shards or a .pack"


def open_catalog(spec: str, what: str = "data") -> Catalog:
    """The catalog of an ImageFolder, a flat folder of images, a file list, tar shards or a pack (module docstring).

    Raises `DataError` with a one-line message that names the path (`what`: ``--data``, ``--val``) and
    says what was expected.
    """
    if not spec or "\x00" in spec:
        raise DataError(f"{what} {spec!r} is not a path; give a folder, a file list, .tar shards or the name "
                        "'digits' or 'cifar10'")
    if is_shard_pattern(spec):
        return _open_shards(spec)
    path = resolved(spec, what)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(f"data folder {path} does not exist (expected {LAYOUTS.format(path)}, or the name 'digits' "
                        "or 'cifar10')") from None
    except OSError as e:  # a name too long, a permission: the message shows the path cut to a readable length
        shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:120]}... ({len(str(path)):,} characters)"
        raise DataError(f"cannot read {what} {shown} ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        if spec.endswith(PACK_SUFFIX) or path.name.endswith(PACK_SUFFIX):
            check_regular(spec, "pack")
            return open_pack(path)
        shard = spec.endswith(SHARD_SUFFIXES) or path.name.endswith(SHARD_SUFFIXES)  # the name given, or linked to
        check_regular(spec, "tar shard" if shard else "file list")
        return _open_shards(str(path)) if shard else _open_list(path)
    entries = _list_dir(path)
    if not entries:
        raise DataError(f"data folder {path} is empty (expected {LAYOUTS.format(path)})")
    folders = sorted(e.name for e in entries if _is_dir(e))
    images = sorted(e.name for e in entries if not _is_dir(e) and e.name.lower().endswith(IMG_EXTENSIONS))
    if folders and images:  # neither layout: say so rather than drop the images or read a subfolder as a class
        raise DataError(f"data folder {path} holds both images ({_some(images)}) and subfolders ({_some(folders)}); "
                        "an ImageFolder keeps images only in class subfolders, a flat folder has no subfolders: "
                        "move one or the other, or give a file list")
    if folders:
        _check_not_splits(spec, folders, what)
        return _open_image_folder(path)
    if any(e.name.endswith(SHARD_SUFFIXES) for e in entries):
        return _open_shards(str(path))
    if not images:
        exts = ", ".join(IMG_EXTENSIONS[:3])
        raise DataError(f"no image files ({exts}, ...) in {path} (expected {LAYOUTS.format(path)})")
    for entry in entries:
        _check_image_entry(entry)
    return Catalog("flat", path, path, PackedStrings(images), np.full(len(images), -1, np.int64), [])


TRAIN_SPLITS = ("train", "training")
HELD_OUT_SPLITS = ("val", "valid", "validation", "test", "testing", "eval")


def _open_shards(spec: str) -> Catalog:
    """The catalog of the tar shards `spec` names (`unison.data.shards`: imported by the runs that read shards)."""
    from .shards import open_shards, shard_paths

    return open_shards(shard_paths(spec))


def _check_not_splits(spec: str, folders: list[str], what: str) -> None:
    """A folder whose subfolders are all named like data splits (``train/``, ``val/``, ``test/``) is the parent of
    the splits, not an ImageFolder of classes: read as one, it trains a 2-class "train"/"val" set with the held-out
    images inside the training data. Refused in one line that names the folders to give instead. A split name
    among other class names is only warned of (a class may be called "test")."""
    splits = [f for f in folders if f.lower() in TRAIN_SPLITS + HELD_OUT_SPLITS]
    if not splits:
        return
    shown = " and ".join(f"{f}/" for f in splits) if len(splits) <= 3 else f"{', '.join(splits)}/"
    if len(splits) < len(folders):
        warnings.warn(f"{what} {spec}: class folder(s) named like data splits ({shown}) beside "
                      f"{len(folders) - len(splits)} other(s); if {spec} holds the splits, give the training split's "
                      "folder", stacklevel=3)
        return
    train = next((f for f in splits if f.lower() in TRAIN_SPLITS), None)
    held = next((f for f in splits if f.lower() in HELD_OUT_SPLITS[:3]), None) or next(
        (f for f in splits if f.lower() in HELD_OUT_SPLITS), None)
    base = spec.rstrip("/") or "/"
    if what == "--val":
        instead = f"give --val {os.path.join(base, held or splits[0])}"
    elif train is not None:
        instead = f"give --data {os.path.join(base, train)}" + (f" --val {os.path.join(base, held)}" if held else "")
    else:
        instead = f"give --data the training split's folder and --val {os.path.join(base, held or splits[0])}"
    raise DataError(f"{what} {spec} holds the splits {shown}, not class folders: {instead}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _list_dir(folder: Path | str, missing_ok: bool = False) -> list[os.DirEntry]:
    """The entries of `folder` not starting with a dot; DataError when it cannot be listed."""
    try:
        with os.scandir(folder) as it:
            return [e for e in it if not e.name.startswith(".")]
    except FileNotFoundError:
        if not missing_ok:
            raise DataError(f"data folder {folder} does not exist") from None
        return []  # removed while the tree was walked: it holds no images now
    except OSError as e:
        raise DataError(f"cannot list the data folder {folder} ({e.strerror or e})") from None


def _is_dir(e: os.DirEntry) -> bool:
    """A folder, or a link to one; False for a link that loops or cannot be followed."""
    try:
        return e.is_dir()
    except OSError:
        return False


def _check_image_entry(e: os.DirEntry) -> None:
    """DataError for an image name that is a FIFO, a device or a socket (reading it would hang or never end).

    A broken link stays listed: reading it fails like any unreadable image (``--on-corrupt``).
    """
    if not e.name.lower().endswith(IMG_EXTENSIONS):
        return
    try:
        if e.is_file() or e.is_dir():
            return
        mode = e.stat().st_mode
    except OSError:
        return
    raise DataError(f"data file {e.path} is {file_kind(mode)}, not an image file; remove it or replace it with "
                    "the image")


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
    entries = _list_dir(root)
    classes = sorted(e.name for e in entries if _is_dir(e))
    if not entries:
        raise DataError(f"data folder {root} is empty ({layout})")
    if not classes:
        raise DataError(f"data folder {root} has no class subfolders ({layout})")
    files: list[str] = []
    labels: list[int] = []
    real_root = os.path.realpath(root)
    class_ids = [_identity(os.stat(root / cls)) for cls in classes]
    seen = {_identity(os.stat(root)), *class_ids}  # links to a class folder: its images are counted there
    for label, cls in enumerate(classes):
        walked_before = class_ids[label] in class_ids[:label]   # two class names for one folder: the first
        found = [] if walked_before else _walk_images(root, cls, real_root, seen)
        files += found
        labels += [label] * len(found)
    if not files:
        exts = ", ".join(IMG_EXTENSIONS[:3])
        raise DataError(f"no image files ({exts}, ...) in the class subfolders of {root} ({layout})")
    empty = sorted(set(classes) - {classes[i] for i in set(labels)})
    if empty:
        warnings.warn(f"{root}: class folder(s) without images kept as classes: {empty[:5]}", stacklevel=4)
    return classes, files, labels


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _walk_images(root: Path, cls: str, real_root: str, seen: set[tuple[int, int]]) -> list[str]:
    """Sorted image paths (relative to `root`) under class folder `cls`, each real folder walked once.

    Links to folders are followed, except into a folder already walked (a loop such as ``up -> ..``)
    or into the data folder itself (those images are counted where they are): each image once.
    """
    found: list[str] = []
    stack = [cls]
    while stack:
        rel_dir = stack.pop()
        for e in _list_dir(root / rel_dir, missing_ok=True):
            if _is_dir(e):
                if _first_visit(e, real_root, seen):
                    stack.append(os.path.join(rel_dir, e.name))
            elif e.name.lower().endswith(IMG_EXTENSIONS):
                _check_image_entry(e)
                found.append(os.path.join(rel_dir, e.name))
    found.sort()
    return found


def _first_visit(e: os.DirEntry, real_root: str, seen: set[tuple[int, int]]) -> bool:
    try:
        key = _identity(e.stat())
    except OSError:
        return False
    if key in seen:
        return False
    if e.is_symlink():
        real = os.path.realpath(e.path)
        if real == real_root or real.startswith(real_root + os.sep):
            return False
    seen.add(key)
    return True


def _open_image_folder(root: Path) -> Catalog:
    classes, files, labels = _scan_image_folder(root)
    return Catalog("folder", root, root, PackedStrings(files), np.asarray(labels, dtype=np.int64), classes)


def _open_list(path: Path) -> Catalog:
    """A file list: per line ``path<TAB>label``, ``path label`` (paths without spaces), ``path`` or ``path<TAB>`` (a
    path with spaces and no label: the tab ends it); ``#`` starts a comment line (docs/guides/your-images.md)."""
    try:
        data = read_regular(str(path), MAX_LIST_BYTES)
    except OSError as e:
        raise DataError(f"cannot read the file list {path} ({e.strerror or e})") from None
    if b"\x00" in data[:4096]:
        raise DataError(f"{path} is neither a folder, a text file list (one image path per line) nor a .tar shard")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of the first path
    except UnicodeDecodeError as e:
        bad_line = data[:e.start].count(b"\n") + 1
        raise DataError(f"file list {path}: line {bad_line} is not UTF-8 text; write the list in UTF-8") from None
    names: list[str] = []
    raw_labels: list[str | None] = []
    line_of: list[int] = []
    spaced: dict[int, str] = {}   # entry -> its whole line, where a space (no tab) parted the path from a label
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip(" \r\f\v")   # not a tab: a trailing one ends a path with spaces that has no label
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, label = _list_line(line)
        _check_list_entry(path, lineno, name, label)
        if label is not None and "\t" not in line:
            spaced[len(names)] = line
        names.append(name)
        raw_labels.append(label)
        line_of.append(lineno)
    if not names:
        raise DataError(f"file list {path} names no images (expected one image path per line)")
    has = [lab is not None for lab in raw_labels]
    if any(has) and not all(has):
        first = line_of[has.index(not has[0])]
        raise DataError(f"file list {path}: line {first} {'has no' if has[0] else 'has a'} label column, unlike "
                        f"line {line_of[0]}; give a label on every line or on none (a path with spaces: a tab before "
                        "its label, or after it when it has none)")
    base = path.parent
    _check_listed_files(path, base, names, line_of, spaced)
    if all(has):
        labels, classes = label_indices([str(lab) for lab in raw_labels],
                                        lambda k: f"file list {path}: line {line_of[k]}")
    else:
        labels, classes = np.full(len(names), -1, np.int64), []
    return Catalog("list", path, base, PackedStrings(names), labels, classes)


def _list_line(line: str) -> tuple[str, str | None]:
    """(path, label or None) of one line of a file list: after the last tab the label (none: empty), else after
    the last space when there is one."""
    if "\t" in line:
        name, label = (part.strip() for part in line.rsplit("\t", 1))
        return name, label or None
    parts = line.strip().rsplit(None, 1)
    return (parts[0], parts[1]) if len(parts) == 2 else (line.strip(), None)


def _check_list_entry(path: Path, lineno: int, name: str, label: str | None) -> None:
    """DataError naming the line for a path or label no file system or class takes."""
    where = f"file list {path}: line {lineno}"
    bad = next((c for c in name + (label or "") if ord(c) < 32 and c != "\t" or ord(c) == 127), None)
    if bad is not None:
        raise DataError(f"{where} holds the control character {bad!r}; give one path (and label) per line")
    longest = max(len(part.encode()) for part in name.split("/"))
    if len(name.encode()) >= _PATH_MAX or longest > _NAME_MAX:
        raise DataError(f"{where}: the path is {len(name):,} characters long, past what the file system takes "
                        f"({_PATH_MAX - 1:,} in all, {_NAME_MAX} per name)")
    if label is not None and len(label) > _NAME_MAX:
        raise DataError(f"{where}: the label is {len(label):,} characters long, past {_NAME_MAX}")


def _check_listed_files(path: Path, base: Path, names: list[str], line_of: list[int],
                        spaced: dict[int, str] | None = None) -> None:
    """Every listed file exists and is a regular file (a FIFO would hang the first read, a device never end). A
    missing one read as ``path label`` from a line with spaces says how that line was read and how to write it."""
    files = [os.path.join(base, n) for n in names]
    for k, st in enumerate(stat_all(files, missing_ok=True)):
        if st is None:
            raise DataError(f"file list {path}: line {line_of[k]}: {files[k]} does not exist"
                            + _spaced_hint(base, names[k], (spaced or {}).get(k)))
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"file list {path}: line {line_of[k]}: {files[k]} is {file_kind(st.st_mode)}, not an "
                            "image file; remove the line or the file")


def _spaced_hint(base: Path, name: str, line: str | None) -> str:
    if line is None:
        return ""
    label = line.strip()[len(name):].strip()
    whole = os.path.join(base, line.strip())
    found = f"; {whole} (the whole line) does" if os.path.isfile(whole) else ""
    return (f" (the line was read as the path {name!r} and the label {label!r}){found}: a path with spaces is "
            "parted from its label by a tab (path<TAB>label), and ends in a tab when it has no label (path<TAB>)")
