"""One owner per run directory: a run holds ``RUN_DIR/.unison.lock`` for its whole life.

Two runs writing into one directory delete each other's temporary files, mix their checkpoints and
interleave ``metrics.csv``; the second run is refused instead (exit 2, one line naming the directory and
the owner: pid, host, start time). The lock is ``fcntl.flock`` on that file, held by the process that
runs the training: unison's launcher (its workers do not lock), the single in-process worker, or rank 0
under torchrun/srun/mpirun. The kernel drops it when that process ends however it ends, so a killed or
preempted run never blocks its own restart (torchrun restarts, SLURM requeues, ``--resume auto``), and
the file left behind means nothing by itself, except that the folder is a run directory (`is_run_dir`: a
fresh run refuses a non-empty folder that is not one, `check_run_dir`, so a user's own files are never
replaced). A run that does not continue the run already in its directory moves that run's files aside first,
into ``earlier-runs/<time>/`` inside it (`set_aside_earlier_run`), so two runs never mix. Children forked while
it is held (data-loader processes) close their copy at once (`os.register_at_fork`), so a straggler cannot hold
a dead run's directory.

Example::

    with RunDirLock("runs/x"):     # RunDirRefused (a ConfigError, exit 2) if another live run holds runs/x
        train(...)
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unison.config.fields import shown
from unison.data.files import read_regular
from unison.errors import RunDirRefused
from unison.paths import Input, is_inside, write_error

from .checkpoint.files import list_checkpoints

LOCK_NAME = ".unison.lock"
EARLIER_RUNS = "earlier-runs"   # where a fresh run moves the files of the run that was in its directory
_HELD: set[int] = set()   # lock file descriptors held by this process


def _close_in_child() -> None:
    for fd in list(_HELD):   # close, never unlock: LOCK_UN here would release the parent's lock too
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class RunDirLock:
    """Exclusive ownership of a run directory (see the module docstring); a context manager."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        if sys.platform == "win32":   # no flock: one owner is not enforced there
            return
        import fcntl

        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):   # no flock here (some NFS/FUSE)
                os.close(fd)
                print(f"unison: warning: cannot lock {self.path} ({e.strerror or e}): this file system does not "
                      "say whether another run writes into the same directory", file=sys.stderr)
                return
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirRefused(f"run directory {self.run_dir} is in use by another run ({owner}); wait for it to "
                              "end, or choose another --out") from None
        self.fd = fd
        _HELD.add(fd)
        try:   # who holds it, for the refusal of the next run; a full disk shows here, before any worker starts
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                      .encode(), 0)
            os.fsync(fd)
        except OSError as e:
            self.release()
            raise write_error(self.path, e) from None

    def _open(self) -> int:
        """The lock file, never through a link: it is truncated once locked, and a link (``.unison.lock ->
        ~/notes.txt``, or a hard link) would have that truncate a user's file."""
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirRefused(f"{self.path} is a symbolic link; unison records the run's owner in that file "
                                    "and never writes through a link: remove the link") from None
            raise write_error(self.path, e) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            what = "is not a regular file" if not stat.S_ISREG(info.st_mode) else "has other hard links"
            raise RunDirRefused(f"{self.path} {what}; unison records the run's owner in that file: remove it")
        return fd

    def release(self) -> None:
        if self.fd is not None:
            _HELD.discard(self.fd)
            os.close(self.fd)   # closing drops the flock
            self.fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())   # a file's text: bounded, printable
    return text if text else "owner not recorded"


def is_run_dir(path: Path) -> bool:
    """`path` is a unison run directory: it holds a run's lock file, a checkpoint, or (runs from before the
    lock existed) a ``config.json`` that is a run's config (a JSON object with "method" and "resolved")."""
    if os.path.lexists(path / LOCK_NAME) or list_checkpoints(path):
        return True
    try:
        config = json.loads(read_regular(   # bounded, regular files only: the folder may hold anything
            str(path / "config.json"), limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and "method" in config and "resolved" in config


def check_run_dir(out: Path) -> None:
    """A fresh run writes config.json, metrics.csv, plot.png, summary.json, train.log and checkpoints/ into
    `out`, replacing what is there: refuse (one line) a non-empty folder that is not a unison run directory."""
    if not out.is_dir() or is_run_dir(out):
        return
    try:
        with os.scandir(out) as entries:
            names = sorted(e.name for _, e in zip(range(1000), entries))
    except OSError:
        return   # an unreadable folder: creating the run's files there says why
    if names:
        some = ", ".join(shown(n, 40) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise RunDirRefused(f"--out {out} already holds files that no unison run wrote ({some}); a run writes its "
                            "config.json, metrics.csv, plot.png, summary.json, train.log and checkpoints/ there and "
                            "would replace them: choose a new or empty folder")


def set_aside_earlier_run(out: Path, inputs: Sequence[Input] = ()) -> tuple[Path, list[str]] | None:
    """Move everything in the run directory `out` but its lock file and ``earlier-runs/`` (checkpoints,
    config.json, metrics.csv, plot.png, summary.json, train.log, tensorboard/, ..., whatever a run or the user put
    there) into a new ``out/earlier-runs/<time>/`` (the time the earlier run started, from its config.json), a
    complete run directory of its own: nothing is lost, and the next run writes into an empty folder. Called by
    the run's owner, holding the lock. Returns the folder and the moved names, or None when nothing was there.
    `inputs`: what this run reads; one of them inside a moved entry is refused (one line) before anything moves."""
    try:
        with os.scandir(out) as entries:
            names = sorted(e.name for e in entries if e.name not in (LOCK_NAME, EARLIER_RUNS))
    except OSError:
        return None
    if not names:
        return None
    for inp in inputs:
        inside = next((n for n in names if inp.path and is_inside(inp.path, out / n)), None)
        if inside is not None:
            raise RunDirRefused(f"{inp.what} {inp.path} lies inside {out / inside}, a file of the earlier run in --out "
                                f"{out}, which this run moves aside to {out / EARLIER_RUNS}: choose another --out")
    target = _new_folder(out / EARLIER_RUNS, _started(out))
    try:
        for name in names:
            os.rename(out / name, target / name)   # within one folder tree: one file system, never a copy
    except OSError as e:
        raise write_error(target / name, e) from None
    return target, names


def _started(out: Path) -> str:
    """When the run in `out` started (its config.json's time, written at its start), as a folder name."""
    for name in ("config.json", "train.log", ""):
        try:
            return time.strftime("%Y%m%d-%H%M%S", time.localtime((out / name).stat().st_mtime))
        except OSError:
            continue
    return time.strftime("%Y%m%d-%H%M%S")


def _new_folder(parent: Path, name: str) -> Path:
    """A folder `parent/name` that did not exist (``name-2``, ``name-3``, ... when it did)."""
    try:
        parent.mkdir(exist_ok=True)
        for n in range(1, 1000):
            folder = parent / (name if n == 1 else f"{name}-{n}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
    except OSError as e:
        raise write_error(parent, e) from None
    raise RunDirRefused(f"{parent} holds 999 earlier runs named {name}: move some away")
