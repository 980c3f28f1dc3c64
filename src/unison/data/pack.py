"""Packs: a data set's encoded images in one file, their bytes back to back plus an offset and label index.

What a pack is for: moving a data set as one small file where a folder of 50,000 files, or tar
shards (a 512-byte header per member, more than a CIFAR JPEG itself), would not fit or would be slow
to copy (a machine reached only through a size-limited upload). A pack adds only its index to the images'
encoded bytes. A pack reads like any other layout: ``--data train.pack``
(and ``--val val.pack``); each sample is one ``os.pread`` (the `Catalog` of kind ``"pack"``), so the
memory path decodes it into one tensor on the device, the streamed path decodes it in loader workers
(simplejpeg), and ``--decode gpu`` hands the bytes to nvJPEG, all through the code of the other layouts.

File layout (little-endian)::

    MAGIC (16 bytes) | image 0 bytes | image 1 bytes | ... | header JSON | offsets int64 [N+1] | labels int64 [N]
    | trailer: header position uint64, header length uint64, N uint64, END (8 bytes)

The header JSON holds ``{"version": 1, "classes": [...], "names": [...]}`` (names: each sample's path in the
data it was packed from, for messages); ``offsets[k]`` is where image k starts and ``offsets[N]`` where the
images end; a label is a class index, or -1 for none (``classes == []``). Sample order is the source's
(an ImageFolder: by class, then path), so the views of a sample are the same from the pack as from its folder.

Errors, one line naming the file: not a pack (another magic), truncated or damaged (the trailer, header or
index do not fit the file, offsets that do not increase), labels outside the classes.

Example::

    write_pack(open_catalog("/data/cifar10/train"), "cifar10-train.pack")
    cat = open_pack("cifar10-train.pack")          # 45,000 samples, 10 classes (open_catalog does the same)
    jpeg = cat.read(17)
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from unison.errors import DataError

from .files import MAX_CLASSES
from .samples import Catalog, PackedStrings

__all__ = ["PACK_SUFFIX", "open_pack", "pack_size", "write_pack"]

PACK_SUFFIX = ".pack"
MAGIC = b"UNISON-PACK\x00v1\x00\x00\x00"
END = b"PACKEND\x00"
_TRAILER = struct.Struct("<QQQ8s")
_VERSION = 1


def write_pack(catalog: Catalog, out: str | Path) -> dict[str, int]:
    """Write every sample of `catalog` (any layout) into the pack `out`, atomically; returns its counts and size."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    offsets = np.zeros(len(catalog) + 1, dtype=np.int64)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            for i in range(len(catalog)):
                offsets[i] = f.tell()
                f.write(catalog.read(i))
            offsets[-1] = header_at = f.tell()
            header = _header(catalog)
            f.write(header)
            f.write(offsets.astype("<i8").tobytes())
            f.write(np.asarray(catalog.labels, dtype="<i8").tobytes())
            f.write(_TRAILER.pack(header_at, len(header), len(catalog), END))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"images": len(catalog), "image_bytes": int(offsets[-1] - offsets[0]), "bytes": out.stat().st_size}


def _header(catalog: Catalog) -> bytes:
    return json.dumps({"version": _VERSION, "classes": list(catalog.classes), "names": catalog.names.tolist()}).encode()


def pack_size(catalog: Catalog) -> int:
    """The bytes `write_pack` would write for `catalog`, from its files' sizes (nothing is read or written)."""
    image_bytes = sum(size for size, _ in catalog.file_stats()) if catalog.kind in ("folder", "flat", "list") \
        else int(catalog.sizes.sum())
    return len(MAGIC) + image_bytes + len(_header(catalog)) + 8 * (2 * len(catalog) + 1) + _TRAILER.size


def open_pack(path: str | Path) -> Catalog:
    """The `Catalog` of the pack at `path` (index only: no image is read); DataError naming the file when it is
    not a pack or is damaged."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise DataError(f"{path} is not a unison pack (no pack header); write packs with "
                            "unison.data.pack.write_pack")
        if size < len(MAGIC) + _TRAILER.size:
            raise DataError(f"pack {path} is truncated or damaged ({size} bytes); write it again")
        f.seek(size - _TRAILER.size)
        header_at, header_len, n, end = _TRAILER.unpack(f.read(_TRAILER.size))
        index_bytes = 8 * (2 * n + 1)
        if end != END or header_at + header_len + index_bytes + _TRAILER.size != size:
            raise DataError(f"pack {path} is truncated or damaged (its index does not fit the file); write it again")
        f.seek(header_at)
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise DataError(f"pack {path} has a damaged header; write it again") from None
        index = np.frombuffer(f.read(index_bytes), dtype="<i8").astype(np.int64)
    offsets, labels = index[:n + 1], index[n + 1:]
    _check_index(path, header, offsets, labels, int(header_at))
    return Catalog("pack", path, path.parent, PackedStrings(header["names"]), labels, list(header["classes"]),
                   shards=[str(path)], shard_of=np.zeros(n, np.int32), offsets=offsets[:-1].copy(),
                   sizes=np.diff(offsets))


def _check_index(path: Path, header: dict, offsets: np.ndarray, labels: np.ndarray, header_at: int) -> None:
    n = len(labels)
    if header.get("version") != _VERSION:
        raise DataError(f"pack {path} is version {header.get('version')}, this unison reads version {_VERSION}; "
                        "write it again with this version")
    if len(header.get("names", ())) != n or n == 0:
        raise DataError(f"pack {path} holds {n} images but names {len(header.get('names', ()))}; write it again")
    if offsets[0] != len(MAGIC) or offsets[-1] != header_at or bool((np.diff(offsets) < 0).any()):
        raise DataError(f"pack {path} has a damaged index (image offsets out of order); write it again")
    classes = header.get("classes", [])
    if len(classes) > MAX_CLASSES:
        raise DataError(f"pack {path} names {len(classes):,} classes, past the {MAX_CLASSES:,} unison takes")
    low, high = (-1, -1) if not classes else (0, len(classes) - 1)
    if bool(((labels < low) | (labels > high)).any()):
        raise DataError(f"pack {path} has labels outside its {len(classes)} classes; write it again")

