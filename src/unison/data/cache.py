"""Where the data package keeps what it derives from the data: decoded images and tar shard indexes.

One place for the two rules both caches follow: the folder is ``$UNISON_CACHE_DIR`` (default
``~/.cache/unison``), and nothing is cached when ``UNISON_NO_CACHE`` is set or when the cache
would lie inside the data's own folder (unison never writes into the data).

Example::

    root = cache_root(Path("/data/in1k"))        # None: do not cache
    if root is not None:
        path = root / "images" / "in1k-<digest>.pt"
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "cache_root"]


def cache_dir() -> Path:
    """``$UNISON_CACHE_DIR``, else ``~/.cache/unison`` (also the default download folder of CIFAR-10)."""
    return Path(os.environ.get("UNISON_CACHE_DIR") or Path.home() / ".cache" / "unison").expanduser()


def cache_root(data_folder: Path) -> Path | None:
    """The resolved cache folder for data in `data_folder`, or None when caching is off or would write into it."""
    if os.environ.get("UNISON_NO_CACHE", "") not in ("", "0"):
        return None
    cache = cache_dir().resolve()
    if cache == data_folder or data_folder in cache.parents:
        return None
    return cache
