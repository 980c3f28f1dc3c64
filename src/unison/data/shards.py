"""WebDataset-style tar shards, read by random access: each tar is indexed once, members read by offset.

Layout (WebDataset's convention, so shards written by ``webdataset.ShardWriter`` or ``tar``
work): a sample is the run of consecutive members sharing a key, the member name up to the
first dot of its base name (``n01440764/img_0001.jpg`` + ``n01440764/img_0001.cls``); its
image is the member whose extension is an image type, its label the integer text of a
``.cls`` (or ``.label``) member. Every sample must have a label or none must.

Why random access and not ``webdataset``'s streaming reader: unison's promise is that the
global batches of an epoch are ``global_batches(n, B, epoch, seed)`` — a permutation of *all*
samples — and that rank r decodes exactly its slice of each. A streaming reader can only
shuffle within a buffer and must give whole shards to ranks and loader workers, so the
batch composition would depend on the number of ranks and workers (and shard counts must
divide evenly). Here the index (``tarfile`` reads the headers only, seeking past the data)
gives every sample's (shard, offset, size); a sample is then one ``os.pread``. Nothing is
assigned per shard, so no sample is lost or duplicated at any W or worker count, and every
sample is in exactly one global batch per epoch (apart from the ``n mod B`` left over by
drop-last, a different few each epoch).

The trade-off: random reads instead of sequential ones. On local disks, SSDs and page-cached
or parallel file systems (Lustre, GPFS, NFS with read-ahead off) a pread of an ImageNet-sized
JPEG costs about what reading it from its own file does, without the per-file open;
on object stores behind a FUSE mount that only stream well, stage the shards locally or use
a folder. Compressed tars (``.tar.gz``) cannot be read by offset and are refused. Indexing
costs one pass over the headers, done once: the
index is cached under ``$UNISON_CACHE_DIR/shard-index`` keyed by path, size and mtime.

Errors, one line naming the file: an empty shard (no bytes, or no image members), a
truncated tar (a member runs past the end, or the end-of-archive blocks are missing), a
missing shard of a brace pattern (names are checked as the pattern expands, at most
`MAX_SHARDS`), a shard named twice, image members sharing one name (each sample needs its own key), a
compressed shard, a shard that is not a regular file (a FIFO, a device), a ``.cls`` label that is not
ASCII digits or is past `unison.data.files.MAX_CLASSES`.

Example::

    cat = open_shards(shard_paths("/data/in1k/train-{0000..1023}.tar"))
    jpeg = cat.read(123_456)
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from unison.config.fields import shown
from unison.errors import DataError
from unison.paths import cache_root

from .files import COMPRESSED, MAX_LABEL_BYTES, SHARD_SUFFIXES, check_regular, is_shard_pattern, parse_label, resolved
from .samples import IMG_EXTENSIONS, Catalog, PackedStrings, integer_classes

__all__ = ["MAX_SHARDS", "SHARD_SUFFIXES", "index_shard", "is_shard_pattern", "open_shards", "shard_paths"]

_IMAGE_EXTS = {e[1:] for e in IMG_EXTENSIONS}
_LABEL_EXTS = ("cls", "label", "cls.txt", "label.txt")
_INDEX_VERSION = 4   # 2: labels parsed strictly and bounded; 3: image members sharing a name refused; 4: one image per key
MAX_SHARDS = 100_000
_INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?\}")
_NO_LABEL = -1


def shard_paths(spec: str) -> list[str]:
    """The shard files of ``x.tar``, a folder of ``*.tar`` or a brace pattern ``train-{0000..0146}.tar``.

    A pattern is expanded lazily and each name checked as it comes (a missing first shard of
    ``{0000000..9999999}`` is found at once), at most `MAX_SHARDS` names.
    """
    if is_shard_pattern(spec):
        paths: list[str] = []
        for name in _expand(spec):
            if len(paths) == MAX_SHARDS:
                raise DataError(f"{spec} names more than {MAX_SHARDS:,} tar shards; write fewer, larger shards")
            path = str(resolved(name, "tar shard"))
            if not os.path.lexists(path):
                raise DataError(f"tar shard {path} of {spec} does not exist")
            paths.append(path)
    elif os.path.isdir(spec):
        root = resolved(spec, "shard folder")
        paths = sorted(str(root / e.name) for e in os.scandir(root)
                       if e.name.endswith(SHARD_SUFFIXES) and not e.name.startswith("."))
    else:
        paths = [str(resolved(spec, "tar shard"))]
    compressed = next((p for p in paths if p.endswith(COMPRESSED)), None)
    if compressed is not None:
        raise DataError(f"tar shard {compressed} is compressed; unison reads samples by offset, which needs "
                        "uncompressed .tar shards (webdataset's ShardWriter writes them)")
    if not paths:
        raise DataError(f"no .tar shards in {spec}")
    _check_distinct(paths, spec)
    for p in paths:  # a FIFO would hang tarfile, a device be read forever
        check_regular(p, "tar shard")
    return paths


def _check_distinct(paths: list[str], spec: str) -> None:
    """A pattern that names one shard twice (``{,}``, overlapping ranges, a link to another shard) would read its
    samples twice an epoch: refuse it."""
    seen: dict[tuple[int, int] | str, str] = {}
    for p in paths:
        try:
            st = os.stat(p)
            key: tuple[int, int] | str = (st.st_dev, st.st_ino)
        except OSError:   # check_regular says why
            key = p
        if key in seen:
            also = "" if seen[key] == p else f" (also as {seen[key]}: the same file)"
            raise DataError(f"{spec} names the tar shard {p} twice{also}; its samples would be read twice an "
                            "epoch: name each shard once")
        seen[key] = p


def _expand(spec: str) -> Iterator[str]:
    """The names of a brace pattern, after refusing one whose ranges multiply past `MAX_SHARDS`.

    braceexpand materialises each range before the first name (``{0000000..9999999}``: ten million
    strings), so the count is bounded from the pattern's text first.
    """
    from braceexpand import braceexpand  # a dependency of webdataset; tiny

    count = 1
    for a, b, step in _INT_RANGE.findall(spec):
        count *= abs(int(a) - int(b)) // max(1, int(step or 1)) + 1
        if count > MAX_SHARDS:
            raise DataError(f"{spec} names more than {MAX_SHARDS:,} tar shards; write fewer, larger shards")
    try:
        yield from braceexpand(spec)
    except Exception as e:  # an unbalanced or malformed pattern
        raise DataError(f"cannot expand the shard pattern {spec} ({e}); write it like train-{{0000..0146}}.tar") \
            from None


def open_shards(paths: list[str]) -> Catalog:
    """One catalog over all samples of `paths`, in shard order then member order."""
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:  # overlaps I/O on network file systems
        indexes = list(pool.map(_cached_index, paths))
    names = [n for idx in indexes for n in idx["names"].tolist()]
    shard_of = np.concatenate([np.full(len(idx["sizes"]), k, np.int32) for k, idx in enumerate(indexes)])
    labels = np.concatenate([idx["labels"] for idx in indexes])
    has = labels != _NO_LABEL
    if has.any() and not has.all():
        k = int(shard_of[int(np.argmax(has != has[0]))])
        raise DataError(f"tar shard {paths[k]}: some samples have a .cls label and others do not; "
                        "label every sample or none")
    classes = integer_classes(labels) if has.all() else []
    return Catalog("shards", Path(paths[0]), Path(paths[0]).parent, PackedStrings(names),
                   labels if classes else np.full(len(labels), -1, np.int64), classes, shards=list(paths),
                   shard_of=shard_of, offsets=np.concatenate([idx["offsets"] for idx in indexes]),
                   sizes=np.concatenate([idx["sizes"] for idx in indexes]))


def index_shard(path: str) -> dict[str, Any]:
    """Image member names, data offsets, sizes and labels (-1: none) of one tar; DataError if empty or truncated."""
    file_size = os.path.getsize(path)
    if file_size == 0:
        raise DataError(f"tar shard {path} is empty (0 bytes)")
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    labels: list[int] = []
    image_of: dict[str, str] = {}   # key -> its image member: one image per key (WebDataset's sample)
    key = None
    try:
        with tarfile.open(path, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                if m.offset_data + m.size > file_size:
                    raise DataError(f"tar shard {path} is truncated: member {m.name} ends at byte "
                                    f"{m.offset_data + m.size}, beyond the file's {file_size} bytes")
                base, ext = _key_and_ext(m.name)
                if base != key:  # a new sample starts
                    key = base
                    names.append("")
                    offsets.append(-1)
                    sizes.append(0)
                    labels.append(_NO_LABEL)
                if ext in _IMAGE_EXTS and base in image_of:   # one key: these would be one sample, the rest dropped
                    _refuse_shared_key(path, image_of[base], m.name, base)
                if ext in _IMAGE_EXTS:
                    image_of[base] = m.name
                if ext in _IMAGE_EXTS and offsets[-1] < 0:
                    names[-1], offsets[-1], sizes[-1] = m.name, m.offset_data, m.size
                elif ext in _LABEL_EXTS:
                    labels[-1] = _read_label(tf, m, path)
            end = tf.offset
    except tarfile.TarError as e:
        raise DataError(f"tar shard {path} is truncated or not an uncompressed tar ({e})") from None
    with open(path, "rb") as f:  # the end-of-archive marker: a zero block where the headers stop
        f.seek(end)
        marker = f.read(512)
    if len(marker) < 512 or any(marker):
        raise DataError(f"tar shard {path} is truncated: no end-of-archive block after byte {end}")
    keep = [k for k, o in enumerate(offsets) if o >= 0]  # samples with an image member
    if not keep:
        raise DataError(f"tar shard {path} holds no image samples (members ending in {', '.join(sorted(_IMAGE_EXTS))})")
    return {"names": PackedStrings([names[k] for k in keep]),
            "offsets": np.asarray([offsets[k] for k in keep], np.int64),
            "sizes": np.asarray([sizes[k] for k in keep], np.int64),
            "labels": np.asarray([labels[k] for k in keep], np.int64)}


def _refuse_shared_key(path: str, first: str, again: str, key: str) -> None:
    what = (f"more than one image member is named {shown(again)}" if first == again else
            f"the image members {shown(first)} and {shown(again)} share the key {shown(key)}")
    raise DataError(f"tar shard {path}: {what}; each sample needs its own key (the name up to the first dot), e.g. "
                    "000000.png, 000001.png")


def _key_and_ext(name: str) -> tuple[str, str]:
    """WebDataset's split: the key is the name up to the first dot of its base name, the rest the extension."""
    folder, base = os.path.split(name)
    dot = base.find(".")
    if dot < 0:
        return name, ""
    return os.path.join(folder, base[:dot]), base[dot + 1:].lower()


def _read_label(tf: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> int:
    where = f"tar shard {path}: label member {m.name}"
    if m.size > MAX_LABEL_BYTES:
        raise DataError(f"{where} holds {m.size:,} bytes; a label is a class index (ASCII digits)")
    data = tf.extractfile(m).read()  # type: ignore[union-attr]
    try:
        text = data.decode("utf-8-sig").strip()  # a byte-order mark is not part of the label
    except UnicodeDecodeError:
        raise DataError(f"{where} is not UTF-8 text; a label is a class index (ASCII digits)") from None
    return parse_label(text, where)


def _cached_index(path: str) -> dict[str, Any]:
    """`index_shard`, from the cache when the shard is unchanged (path, size and mtime)."""
    st = os.stat(path)
    digest = hashlib.sha256(repr((_INDEX_VERSION, path, st.st_size, st.st_mtime_ns)).encode()).hexdigest()[:24]
    cache = cache_root(Path(path).parent)
    file = (cache / "shard-index" / f"{Path(path).stem}-{digest}.npz") if cache is not None else None
    if file is not None and file.is_file():
        try:
            with np.load(file) as z:
                names = PackedStrings([])
                names.blob, names.offsets = z["name_blob"], z["name_offsets"]
                return {"names": names, "offsets": z["offsets"], "sizes": z["sizes"], "labels": z["labels"]}
        except Exception:  # a partial or foreign file: index again
            pass
    index = index_shard(path)
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(f"{file.stem}.{os.getpid()}.tmp.npz")
            names = index["names"]
            np.savez(tmp, name_blob=names.blob, name_offsets=names.offsets,  # type: ignore[union-attr]
                     offsets=index["offsets"], sizes=index["sizes"], labels=index["labels"])
            os.replace(tmp, file)  # atomic: concurrent ranks never read a partial index
        except OSError:
            pass
    return index
