"""The files of a run's checkpoints: where they are, how they are written atomically, and which are kept.

Layout of a run directory::

    RUN_DIR/checkpoints/step_00001200.pt   # a complete checkpoint (`pt`), one per saved step
    RUN_DIR/checkpoints/step_00001300.dcp/ # ... of a --shard full run: a directory (`dcp`)
    RUN_DIR/checkpoints/latest             # text file naming the most recently saved one

Both kinds share this module so that they are found, pointed to by ``latest``, pruned and
written the same way: a temporary sibling, fsync, `os.replace` onto the final name, fsync of
the directory. A kill at any instant leaves the previous checkpoint and ``latest`` intact;
temporaries of a killed save are ignored by the listing and removed by the next save.

unison writes no links there, so a symbolic link among a run's checkpoints was put there by hand (to another
run's checkpoint, or to one of this run's under a later step's name): reading the run directory refuses it in
one line (`first_loadable`), before anything else happens to the run.

`warn_once`: a warning about what a command reads (a damaged latest checkpoint passed over) is shown once per
command, though the command, its pre-flight checks and its workers each read the same files.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from unison.distributed.launch_env import detect_launch_env
from unison.errors import CheckpointError, ConfigError, CorruptCheckpointError

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
DCP_SUFFIX = ".dcp"
DCP_HEADER = "unison.pt"   # the header file inside a .dcp checkpoint directory
METADATA = ".metadata"   # DCP's index of which tensor slices are where

STEP_RE = re.compile(r"step_(\d{8,})\.(?:pt|dcp)")   # .dcp: a directory (sharded runs)
T = TypeVar("T")
# resume, eval, embed, export, --init and --teacher all read through `first_loadable`: no command's own word ("resume")
NO_CHECKPOINT_HINT = "give the run directory of a unison train run that wrote checkpoints, or a checkpoint file"
_TMP_RE = re.compile(r"\.(?:step_\d{8,}\.pt|latest)\.\d+\.[0-9a-f]+\.tmp")
ANNOUNCED_ENV = "UNISON_ANNOUNCED"   # digests of the warnings `warn_once` has shown, for the processes started later
_ANNOUNCED_MAX = 64


def warn_once(message: str) -> None:
    """Warn `message` (a `RuntimeWarning`) once per command: a command reads a checkpoint in its own process (the
    options, the pre-flight checks) and again in every worker, and each read would say the same.

    Not again in this process, nor in the workers it starts (unison's launcher gives them its environment, where
    the message's digest is kept), nor in a process that a launcher started as a rank other than 0 (torchrun, srun
    and mpirun start every rank as a command of its own, which reads the same files)."""
    digest = hashlib.sha256(message.encode("utf-8", "replace")).hexdigest()[:16]
    said = os.environ.get(ANNOUNCED_ENV, "").split()
    if digest in said:
        return
    os.environ[ANNOUNCED_ENV] = " ".join([*said[-(_ANNOUNCED_MAX - 1):], digest])
    try:
        launched = detect_launch_env()
    except ConfigError:   # malformed launcher variables: the command itself says so
        launched = None
    if launched is None or launched.rank == 0:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------ discovery
def checkpoint_dir(run_dir: str | Path) -> Path:
    """``RUN_DIR/checkpoints`` (``RUN_DIR/checkpoints`` itself is accepted too)."""
    run_dir = Path(run_dir)
    if run_dir.name == CHECKPOINT_DIR and not (run_dir / CHECKPOINT_DIR).is_dir():
        return run_dir
    return run_dir / CHECKPOINT_DIR


def named_checkpoint(path: str | Path) -> Path:
    """What a user names as a checkpoint: ``RUN/checkpoints/latest`` (the pointer file) means its run's latest
    checkpoint, i.e. the run directory; anything else is itself."""
    path = Path(path)
    if path.name == LATEST and path.parent.name == CHECKPOINT_DIR and path.is_file():
        return path.parent
    return path


def step_of(path: Path) -> int:
    """The step in a checkpoint's name (``step_00000042.pt`` -> 42)."""
    return int(STEP_RE.fullmatch(path.name).group(1))  # type: ignore[union-attr]


def is_checkpoint_name(path: Path) -> bool:
    """A checkpoint's own name (``step_N.pt`` or ``step_N.dcp``), as opposed to a run directory."""
    return STEP_RE.fullmatch(path.name) is not None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, sorted by step (temporary files are ignored)."""
    try:
        entries = list(checkpoint_dir(run_dir).iterdir())
    except OSError:  # missing directory = no checkpoints
        return []
    found = [p for p in entries if STEP_RE.fullmatch(p.name) and (p.is_dir() if p.suffix == DCP_SUFFIX else p.is_file())]
    return sorted(found, key=lambda p: (step_of(p), p.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The most recently saved checkpoint of a run, or None if there is none.

    Read from `checkpoints/latest`; if that is missing or names no existing
    checkpoint, the highest step wins.
    """
    ckpt_dir = checkpoint_dir(run_dir)
    try:
        name = (ckpt_dir / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    # fullmatch also rules out path tricks such as "../x.pt" in a hand-edited pointer.
    if STEP_RE.fullmatch(name) and (ckpt_dir / name).exists():
        return ckpt_dir / name
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def newest_first(paths: list[Path], current_step: int) -> list[Path]:
    """`paths` newest first: the highest steps up to `current_step`, then those above it.

    Higher steps were left by a run that was later resumed from an earlier checkpoint: they rank
    last, so the resumed run's own checkpoints win (deterministic, unlike file mtimes)."""
    return sorted(paths, key=lambda p: (step_of(p) <= current_step, step_of(p)), reverse=True)


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints of a run directory in the order a resume tries them (latest first); [] if none."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return []
    return [latest] + newest_first([p for p in list_checkpoints(run_dir) if p != latest], step_of(latest))


def first_loadable(run_dir: Path, read: Callable[[Path], T]) -> T:
    """`read(candidate)` of the run directory's latest checkpoint, falling back (with a warning, `warn_once`) past
    corrupt ones.

    Only `CorruptCheckpointError` falls back; any other error (another method, an unsafe file, a link) is raised."""
    candidates = resume_candidates(run_dir)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)}; {NO_CHECKPOINT_HINT}")
    first_error: CheckpointError | None = None
    for i, candidate in enumerate(candidates):
        refuse_link(candidate)
        try:
            return read(candidate)
        except CorruptCheckpointError as e:
            first_error = first_error or e
            if i + 1 < len(candidates):
                warn_once(f"{e}; falling back to {candidates[i + 1].name}")
    assert first_error is not None
    raise first_error


def refuse_link(candidate: Path) -> None:
    """A symbolic link among a run directory's checkpoints: `CheckpointError` (one line) naming it and its target.

    unison never writes one, so it was made by hand; read as the run's latest it would continue another run's
    checkpoint, or this run's under a later step's name, in this directory."""
    if not candidate.is_symlink():
        return
    try:
        target = os.readlink(candidate)
    except OSError:
        target = "?"
    raise CheckpointError(f"{candidate} is a symbolic link (to {target[:200]}); a run's checkpoints are its own "
                          f"files, which unison never writes as links: remove the link from {candidate.parent} "
                          "(to continue the run it points to, --resume that file with a new --out)")


# ------------------------------------------------------------------ writing
def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (not possible on Windows, where replace is already durable)."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # some network/FUSE filesystems
            raise
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file of `directory` (one level), then the directory itself."""
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


class _CheckedWriter:
    """The file object torch.save writes to: every byte reaches the file, or the error is kept.

    torch's zip writer calls ``write`` from C++ and reports a failed or short write as
    ``RuntimeError: unexpected pos ...``, losing the `OSError` (ENOSPC, EIO) and even a
    KeyboardInterrupt raised inside ``write``; `error` keeps the original so that the caller
    can raise it. `on_write(bytes_written)` runs after every write (abort checks, tests).
    """

    def __init__(self, fd: int, on_write: Callable[[int], None] | None = None) -> None:
        self.fd, self.on_write, self.written = fd, on_write, 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):   # os.write may write less than asked (a filling disk): go on until an error
                done += os.write(self.fd, view[done:])
            self.written += done
            if self.on_write is not None:
                self.on_write(self.written)
            return done
        except BaseException as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        pass


def atomic_write(path: Path, write: Callable[[BinaryIO], object],
                 on_write: Callable[[int], None] | None = None) -> None:
    """Write via a temporary sibling, fsync, rename onto `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open (not mkstemp) so the file gets the usual umask-derived mode, not 0600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        try:
            writer = _CheckedWriter(fd, on_write)
            try:
                write(writer)  # type: ignore[arg-type]
            except BaseException as e:
                if writer.error is not None and writer.error is not e:
                    raise writer.error from None  # the real cause (ENOSPC, EIO, an interrupt), not the zip writer's
                raise
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def point_latest(ckpt_dir: Path, final: Path) -> None:
    """Atomically make ``latest`` name `final` (after `final` itself is complete and durable)."""
    atomic_write(ckpt_dir / LATEST, lambda f: f.write(final.name.encode() + b"\n"))


def remove_temporaries(ckpt_dir: Path) -> None:
    """Temporary files and directories left by saves that were killed."""
    for p in ckpt_dir.iterdir():
        if _TMP_RE.fullmatch(p.name):
            try:
                p.unlink()
            except OSError:
                pass
    for p in ckpt_dir.glob(f".step_*{DCP_SUFFIX}.*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted one under its final name:
    renamed to a temporary name first (atomic), then removed (a kill in between leaves a temporary)."""
    doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(ckpt_dir: Path, keep: int, written: Path) -> None:
    """Keep `written` and the `keep` - 1 newest others (`newest_first`); a failed delete only warns."""
    others = newest_first([p for p in list_checkpoints(ckpt_dir) if p.name != written.name], step_of(written))
    for p in others[keep - 1:]:
        try:
            if p.is_dir():
                remove_checkpoint_dir(p)
            else:
                p.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a failed prune must not fail a save that succeeded
            warnings.warn(f"could not delete old checkpoint {p} ({e.strerror or e})", RuntimeWarning, stacklevel=3)


def write_failure_message(final: Path, previous: Path | None, e: OSError) -> str:
    """One line: why `final` could not be written, and the last good checkpoint, which is intact."""
    intact = (f"the last good checkpoint is {previous} (intact)" if previous is not None
              else "there is no earlier checkpoint")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        then = "continue with --resume auto" if previous is not None else "start again"
        return f"{what}: could not write checkpoint {final}; {intact}; free space, then {then}"
    if e.errno == errno.EROFS:
        return f"read-only file system: could not write checkpoint {final}; {intact}"
    reason = e.strerror or (errno.errorcode.get(e.errno, "") if e.errno else "") or str(e)
    return f"could not write checkpoint {final} ({reason}); {intact}"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A DCP checkpoint directory (step_N.dcp)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == DCP_SUFFIX or (path / METADATA).is_file())
