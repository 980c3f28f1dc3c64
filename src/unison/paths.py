"""Output paths: what a command writes, checked against what it reads and against what is already there.

One rule for every command that writes a file the user names (``export --out`` and its sidecar, ``eval --json``,
``embed --out`` and its names file, ``plot --out``, the files of ``bench --out``), in one place so that each
command applies the same check (``train --out`` is a run directory, with rules of its own: `unison.training`):

* an output is never the same file as an input (the checkpoint read, a run directory, the data), nor inside
  an input that is a tree (a data folder, a sharded checkpoint);
* two outputs of one command are never the same file (``export --out x.json``: the sidecar is ``x.json``);
* **an existing file is replaced only with ``--overwrite``** (`OVERWRITE_HELP`), the same flag in every command,
  whoever wrote the file (an earlier output of the same command too: which run's it is, the command cannot know);
  without it the command refuses in one line before any work, and the file is left as it is. With it, a file
  is still never replaced where it is an input, a directory or not a regular file;
* an `OSError` while writing (full disk, read-only, a file where a folder should be) is one line naming the
  file (`write_error`), not a traceback.

The caches follow a rule of the same kind (`cache_root`): what unison derives from the data (decoded images, tar
shard indexes) goes to ``$UNISON_CACHE_DIR`` (default ``~/.cache/unison``), and nothing is cached when
``UNISON_NO_CACHE`` is set or when the cache would lie inside the data's own folder (unison never writes into the
data).

Example::

    out = check_output("bb.pt", "--out", inputs=[Input("--checkpoint", ckpt)], overwrite=opts.overwrite)
    root = cache_root(Path("/data/in1k"))        # None: do not cache
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from unison.errors import ConfigError


@dataclass(frozen=True)
class Input:
    """A path a command reads: `what` names it in messages (an option such as ``--checkpoint``); `tree`:
    everything inside it is read too (a data folder, a sharded checkpoint, a run's checkpoints)."""

    what: str
    path: str | Path
    tree: bool = False


NAME_MAX = 255    # bytes of one file or folder name (Linux and macOS file systems)
PATH_MAX = 4096   # bytes of a path the kernel takes, its final NUL included (Linux)


TEMPORARY_ROOM = 22   # what an atomic write adds to a file's name: ".NAME.PID.HEX.tmp"
RUN_FILE_ROOM = 64    # the longest name a training run writes below --out: checkpoints/.step_N.pt.PID.HEX.tmp


def path_too_long(path: str | Path, room: int = 0, name_room: int = 0) -> str | None:
    """Why the file system would refuse `path` (ENAMETOOLONG, a traceback from wherever it is first used), or
    None: a name past `NAME_MAX` bytes (the last one past `NAME_MAX` - `name_room`: its temporary name's), or the
    absolute path, with `room` bytes for the names a command writes below it, past `PATH_MAX`."""
    parts = Path(path).parts
    for k, part in enumerate(parts):
        limit = NAME_MAX - (name_room if k == len(parts) - 1 else 0)
        if len(os.fsencode(part)) > limit:
            why = f" ({NAME_MAX} less the {name_room} its temporary name adds)" if limit < NAME_MAX else ""
            return (f"its name {part[:24]!r}... is {len(os.fsencode(part)):,} bytes long, past the {limit}{why} a "
                    "file or folder name may have; give a shorter name")
    total = len(os.fsencode(os.path.abspath(path))) + room
    if total >= PATH_MAX:
        files = f" with the {room} bytes of the names written below it" if room else ""
        return (f"it is {total:,} bytes long as an absolute path{files}, past the {PATH_MAX - 1} a path may have; "
                "give a shorter path")
    return None


def short_path(path: str | Path) -> str:
    """`path` for a message: a long one cut to its first and last 40 characters."""
    text = str(path)
    return text if len(text) <= 100 else f"{text[:40]}...{text[-40:]} ({len(text):,} characters)"


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(path)).resolve()


def same_file(a: str | Path, b: str | Path) -> bool:
    """`a` and `b` name the same file or directory (links and hard links included; either may not exist)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return _resolved(a) == _resolved(b)


def is_inside(path: str | Path, directory: str | Path) -> bool:
    """`path` is `directory` or lies below it (after resolving links)."""
    p, d = _resolved(path), _resolved(directory)
    return p == d or d in p.parents


OVERWRITE_HELP = ("replace an output file that already exists (never an input, a directory or another output of "
                  "this command); without it an existing file is left as it is and nothing is done")


def check_output(path: str | Path, flag: str, *, inputs: Sequence[Input] = (),
                 others: Sequence[tuple[str, str | Path]] = (), overwrite: bool = False,
                 own: Callable[[Path], bool] | None = None, own_text: str = "",
                 label: str | None = None) -> Path:
    """Refuse (`ConfigError`, one line) an output file that is an input, lies inside an input tree, is another
    output of the same command, is a directory, or exists while `overwrite` (``--overwrite``) is not given.
    `own`/`own_text`: how the message names an existing file this command wrote ("an earlier unison export");
    `label` names the file in messages (default: "`flag` `path`")."""
    p = Path(path)
    name = label or f"{flag} {p}"
    too_long = path_too_long(p, name_room=TEMPORARY_ROOM)
    if too_long:
        raise ConfigError(f"{label or f'{flag} {short_path(p)}'}: {too_long}")
    for inp in inputs:
        if same_file(p, inp.path) or (inp.tree and Path(inp.path).is_dir() and is_inside(p, inp.path)):
            where = "is" if same_file(p, inp.path) else "lies inside"
            raise ConfigError(f"{name} {where} {inp.path} ({inp.what}), which this command reads; writing there "
                              f"would destroy or shadow it: choose another {flag}")
    for other_flag, other in others:
        if same_file(p, other):
            raise ConfigError(f"{name} is also {other_flag}; the two outputs would overwrite each other: "
                              f"choose another {flag}")
    if p.is_dir():
        raise ConfigError(f"{name} is a directory; give a file name, e.g. {p / 'result'}{p.suffix or '.json'}")
    if p.exists() or p.is_symlink():
        if not p.is_file():
            raise ConfigError(f"{name} exists and is not a regular file; choose another {flag}")
        if not overwrite:
            whose = f" ({own_text})" if own_text and own is not None and own(p) else ""
            raise ConfigError(f"{name} already exists{whose}; it is left as it is: pass --overwrite to replace it, "
                              f"or choose another {flag}")
    return p


def write_error(path: str | Path, e: OSError, flag: str = "--out", kept: str = "") -> ConfigError:
    """The one-line error for an output that could not be written (full disk, read-only, not a folder, ...);
    `kept`: what was left as it was (as training names its last good checkpoint)."""
    kept = f"; {kept}" if kept else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return ConfigError(f"{what}: could not write {path}{kept}; free space or choose another {flag}")
    if e.errno == errno.EROFS:
        return ConfigError(f"read-only file system: could not write {path}{kept}; choose another {flag}")
    blocking = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:   # mkdir's "File exists" / "Not a directory" would not say which
        return ConfigError(f"could not write {path}: {blocking} is a file, not a folder; choose another {flag}")
    reason = e.strerror or (errno.errorcode.get(e.errno, "") if e.errno else "") or str(e)
    return ConfigError(f"could not write {path} ({reason}){kept}; choose another {flag}")


def write_text_atomic(path: str | Path, text: str, flag: str = "--out",
                      error: Callable[[Path, OSError], Exception] | None = None) -> Path:
    """Write `text` to `path` through a temporary sibling and a rename (a reader never sees half a file); an
    `OSError` becomes `write_error`'s one line (`error(path, oserror)`'s where given: a training run's files name
    its last good checkpoint) and leaves no temporary behind."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise (error(p, e) if error is not None else write_error(p, e, flag)) from None
    return p


# ---- where the data package caches what it derives from the data

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
