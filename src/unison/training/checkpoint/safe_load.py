"""Reading checkpoint files without ever running code from them, with one-line errors.

* ``.pt`` files (and a ``.dcp`` directory's ``unison.pt``): regular files only (a FIFO would block), read with
  ``torch.load(weights_only=True)``;
  a file that holds Python objects which would run code when unpickled is refused.
* DCP's ``.metadata`` is a plain pickle, and DCP loads non-tensor entries (optimizer
  hyper-parameters) with ``torch.load(weights_only=False)``. `SafeReader` unpickles ``.metadata``
  with an allow-list of DCP's own metadata classes (plus ``torch.Size``, dtypes, layouts, paths)
  and checks that every shard file named in it is a plain file inside the checkpoint directory and that no
  tensor it describes is larger than the shard files together (a loader allocates them before reading);
  `SafeLoadPlanner` loads non-tensor entries with ``weights_only=True``; tensors are already read
  with ``weights_only=True`` by DCP.

Truncated or damaged files raise `CorruptCheckpointError`, on which a run directory falls back to
an earlier checkpoint; anything unsafe raises `CheckpointError`.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch

from unison.config.distributed import checked_device
from unison.errors import CheckpointError, CorruptCheckpointError

from .files import METADATA


def short_reason(e: BaseException) -> str:
    """An exception as ``Type: first sentence`` (at most 160 characters), for one-line messages."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". ")[0]
    return f"{type(e).__name__}: {text}"[:160] if text else type(e).__name__


def corrupt(path: Path, e: BaseException) -> CorruptCheckpointError:
    """The error for a truncated or damaged checkpoint (a run directory falls back to an earlier one)."""
    return CorruptCheckpointError(
        f"checkpoint {path} is truncated or corrupt ({short_reason(e)}); use an earlier checkpoint")


def _starts_with(path: Path, prefix: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False


def load_file(path: Path, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with one-line errors. `mmap`: tensors are mapped, not read
    (what a header read wants); only for zip files (what torch.save writes), others are read normally.

    A `map_location` that names a device is checked first (`checked_device`): torch's error for a device that is
    not one, or not here, comes from inside the read and would otherwise be taken for damage to the file; so would
    running out of memory while the tensors are placed."""
    if isinstance(map_location, (str, torch.device, int)):
        checked_device(map_location, "map_location")
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):   # a FIFO would block the read, a device never end it
            raise CheckpointError(f"checkpoint {path} is not a regular file; pass a checkpoint file or a run directory")
        if info.st_size == 0:
            raise CorruptCheckpointError(f"checkpoint {path} is empty (0 bytes); use an earlier checkpoint")
        mmap = mmap and _starts_with(path, b"PK")
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        msg = str(e)
        found = re.search(r"GLOBAL [\w.]+", msg)
        # A refusal when the weights-only unpickler met a global (code it would have to import
        # and call; torch words this differently across versions) or when the file is a plain
        # pickle that torch.save did not write. Anything else is damage.
        if "weights only" in msg.lower() and (found or _starts_with(path, b"\x80")):
            what = f" ({found.group(0)})" if found else ""
            raise CheckpointError(
                f"refusing to load {path}: it holds Python objects that could run code when unpickled{what}; "
                f"only load checkpoints written by unison") from None
        raise corrupt(path, e) from None
    except OSError as e:
        if e.errno == errno.EINVAL:   # torch's zip reader seeking before the start of a short (truncated) file
            raise corrupt(path, e) from None
        raise CheckpointError(f"could not read checkpoint {path} ({e.strerror or e})") from e
    except (MemoryError, torch.OutOfMemoryError) as e:   # the machine's limit, not the file's fault
        where = f" onto {map_location}" if isinstance(map_location, (str, torch.device)) else ""
        raise CheckpointError(f"not enough memory to read checkpoint {path}{where} ({short_reason(e)}); free memory "
                              "or read it onto another device") from None
    except Exception as e:  # RuntimeError (zip), EOFError, KeyError, ... from a damaged file
        raise corrupt(path, e) from None


# ------------------------------------------------------------------ DCP
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata; any other global (code to import and call) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   (torch.dtype, torch.layout,
                                                                                    torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load the DCP metadata: it names {module}.{name}, which could run code "
                              "when unpickled; only load checkpoints written by unison")


def read_metadata_safely(directory: Path) -> Any:
    """The `Metadata` of a DCP checkpoint, unpickled with the allow-list; shard files checked."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(directory / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"could not read {directory / METADATA} ({e.strerror or e})") from e
    except Exception as e:  # truncated or damaged pickle
        raise corrupt(directory, e) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{directory / METADATA} is not DCP metadata; the checkpoint is damaged")
    for info in (metadata.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", "..") or not (directory / rel).is_file():
            raise CheckpointError(f"{directory / METADATA} names the shard file {rel[:80]!r}, which is not a file in "
                                  f"{directory}; the checkpoint is damaged or not unison's")
    stored = sum((directory / rel).stat().st_size
                 for rel in {str(info.relative_path) for info in (metadata.storage_data or {}).values()})
    _check_entries(metadata, directory, stored)
    return metadata


def _check_entries(metadata: Any, directory: Path, stored: int) -> None:
    """Every entry's name bounded; every tensor's size non-negative, its dtype a dtype, and its bytes within what
    the shard files hold (a loader allocates the tensors the metadata describes before it reads a byte)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or len(entries) > 1_000_000:
        raise CheckpointError(f"{directory / METADATA} has no valid list of entries; the checkpoint is damaged")
    for fqn, md in entries.items():
        if not isinstance(fqn, str) or not 0 < len(fqn) <= 1000:
            raise CheckpointError(f"{directory / METADATA} has an entry named {str(fqn)[:60]!r}...; "
                                  "the checkpoint is damaged")
        if isinstance(md, BytesStorageMetadata):
            continue
        size, dtype = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None)
        ok = (isinstance(md, TensorStorageMetadata) and isinstance(dtype, torch.dtype)
              and isinstance(size, tuple) and len(size) <= 16 and all(type(n) is int and n >= 0 for n in size))
        if ok and isinstance(size, tuple) and isinstance(dtype, torch.dtype):
            numel = 1
            for n in size:
                numel *= n
            ok = numel * dtype.itemsize <= stored
        if not ok:
            raise CheckpointError(f"{directory / METADATA} describes {fqn[:80]!r} as {str(size)[:60]} of "
                                  f"{str(dtype)[:30]}, more than its {stored} bytes of shards hold or not a "
                                  "tensor; the checkpoint is damaged")
