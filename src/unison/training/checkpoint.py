"""Crash-safe checkpoints: atomic saves, safe loads, clear errors.

Layout of a run directory::

    RUN_DIR/checkpoints/step_00001200.pt   # complete checkpoints, one per saved step
    RUN_DIR/checkpoints/step_00001300.dcp/ # ... of a --shard full run: a directory (`dcp_checkpoint`)
    RUN_DIR/checkpoints/latest             # text file naming the most recently saved one

Guarantees
----------
* **Atomic.** A checkpoint is serialised to a temporary file in the same directory,
  flushed and fsync'ed, then `os.replace`d onto its final name and the directory is
  fsync'ed; `latest` is replaced the same way afterwards. A kill at any instant leaves
  the previous complete checkpoint loadable and `latest_checkpoint` pointing to a
  complete file. Temporary files of a killed save are ignored and removed by the next save.
* **Disk full, read-only or failing filesystem.** An `OSError` while saving (ENOSPC, EDQUOT,
  EROFS, EIO from write or fsync) removes the temporary file, keeps every earlier checkpoint
  and raises `CheckpointError` naming the last good checkpoint. torch's zip writer turns a
  failed or short write into ``RuntimeError: unexpected pos ...``; the file object it writes
  to (`_CheckedWriter`) writes every byte or records the `OSError`, which is raised instead.
* **Safe to load.** `load_checkpoint` always uses ``torch.load(weights_only=True)``: a
  checkpoint holds only tensors, numbers, strings, bools, None, lists, tuples and dicts,
  and a file that would run code when unpickled is refused, never executed.
* **Self-describing.** Every checkpoint carries a header
  ``{"format": "unison-checkpoint", "version": 1, "method": str, "step": int, "config": dict}``
  next to the caller's entries (model, optimizer, queues, schedule, RNG, ...).

Only rank 0 may call `save_checkpoint` (one writer per run directory): that is the
caller's business. Every rank may call `load_checkpoint`.

Example::

    state = {"method": "moco", "config": cfg.to_dict(), "model": model.state_dict(),
             "optimizer": opt.state_dict(), "rng": pack_rng_state()}
    if rank() == 0:
        save_checkpoint(run_dir, state, step=step, keep=3)

    ckpt = load_checkpoint(run_dir, expect_method="moco")   # latest complete checkpoint
    check_compatible(model, ckpt["model"])
    model.load_state_dict(ckpt["model"])
    restore_rng_state(ckpt["rng"])
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import secrets
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from unison.errors import CheckpointError

FORMAT = "unison-checkpoint"
VERSION = 1
CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"

_STEP_RE = re.compile(r"step_(\d{8,})\.(?:pt|dcp)")   # .dcp: a directory (sharded runs, dcp_checkpoint.py)
_TMP_RE = re.compile(r"\.(?:step_\d{8,}\.pt|latest)\.\d+\.[0-9a-f]+\.tmp")
_ALLOWED = "tensors, numbers, strings, bools, None, lists, tuples and dicts"


class _CorruptCheckpoint(CheckpointError):
    """The file is truncated or damaged (a run directory falls back to an earlier checkpoint)."""


# ------------------------------------------------------------------ discovery
def _checkpoint_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    # Also accept RUN_DIR/checkpoints itself.
    if run_dir.name == CHECKPOINT_DIR and not (run_dir / CHECKPOINT_DIR).is_dir():
        return run_dir
    return run_dir / CHECKPOINT_DIR


def _step_of(path: Path) -> int:
    return int(_STEP_RE.fullmatch(path.name).group(1))  # type: ignore[union-attr]


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, sorted by step (temporary files are ignored)."""
    ckpt_dir = _checkpoint_dir(run_dir)
    try:
        entries = list(ckpt_dir.iterdir())
    except OSError:  # missing directory = no checkpoints
        return []
    found = [p for p in entries if _STEP_RE.fullmatch(p.name) and (p.is_dir() if p.suffix == ".dcp" else p.is_file())]
    return sorted(found, key=lambda p: (_step_of(p), p.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The most recently saved checkpoint of a run, or None if there is none.

    Read from `checkpoints/latest`; if that is missing or names no existing
    checkpoint, the highest step wins.
    """
    ckpt_dir = _checkpoint_dir(run_dir)
    try:
        name = (ckpt_dir / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    # fullmatch also rules out path tricks such as "../x.pt" in a hand-edited pointer.
    if _STEP_RE.fullmatch(name) and (ckpt_dir / name).exists():
        return ckpt_dir / name
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# ------------------------------------------------------------------ saving
def _check_plain(obj: Any, where: str) -> None:
    """Raise unless `obj` holds only types that `torch.load(weights_only=True)` rebuilds."""
    if isinstance(obj, torch.Tensor) or obj is None or type(obj) in (bool, int, float, str):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if not (k is None or type(k) in (bool, int, float, str)):
                raise CheckpointError(
                    f"{where} has a key of type {type(k).__module__}.{type(k).__qualname__}; "
                    "checkpoint dict keys must be strings or numbers")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    # Caught here rather than at resume time, when the run is already lost.
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only "
        f"{_ALLOWED} (convert it, e.g. with float(), .tolist(), torch.as_tensor() or .to_dict())")


def _validate_state(state: Any, step: Any, keep: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if type(keep) is not int or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}")
    if not isinstance(state.get("method"), str) or not state["method"]:
        raise CheckpointError("state['method'] must be the method name (a non-empty str), e.g. 'moco'")
    if type(state.get("config")) not in (dict, OrderedDict):
        got = type(state["config"]).__name__ if "config" in state else "nothing"
        raise CheckpointError(f"state['config'] must be a plain dict (e.g. cfg.to_dict()), got {got}")
    if "step" in state and state["step"] != step:
        raise CheckpointError(f"state['step'] is {state['step']!r} but step={step}; drop it or make them agree")
    _check_plain(state, "state")


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on Windows, where replace is already durable.
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


def _atomic_write(path: Path, write: Callable[[BinaryIO], object],
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
    _fsync_dir(path.parent)


def _remove_temporaries(ckpt_dir: Path) -> None:
    for p in ckpt_dir.iterdir():
        if _TMP_RE.fullmatch(p.name):
            try:
                p.unlink()
            except OSError:
                pass


def _newest_first(paths: list[Path], current_step: int) -> list[Path]:
    # The newest checkpoints are the highest steps up to the current one. Higher steps were
    # left by a run that was later resumed from an earlier checkpoint: they rank last, so
    # the resumed run's own checkpoints are kept (deterministic, unlike file mtimes).
    return sorted(paths, key=lambda p: (_step_of(p) <= current_step, _step_of(p)), reverse=True)


def _prune(ckpt_dir: Path, keep: int, written: Path) -> None:
    others = _newest_first([p for p in list_checkpoints(ckpt_dir) if p.name != written.name], _step_of(written))
    for p in others[keep - 1:]:
        try:
            if p.is_dir():
                from .dcp_checkpoint import remove_checkpoint_dir

                remove_checkpoint_dir(p)
            else:
                p.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:  # a failed prune must not fail a save that succeeded
            warnings.warn(f"could not delete old checkpoint {p} ({e.strerror or e})", RuntimeWarning, stacklevel=3)


def save_checkpoint(run_dir: str | Path, state: dict, step: int, keep: int = 3,
                    on_write: Callable[[int], None] | None = None) -> Path:
    """Atomically write `state` as ``RUN_DIR/checkpoints/step_{step:08d}.pt``; keep the newest `keep`.

    The newest are this one and the highest steps below it; checkpoints of higher steps
    (left before the run was resumed from an earlier one) are pruned first.

    `state` must contain "method" (str) and "config" (plain dict) and otherwise only
    tensors, numbers, strings, bools, None, lists, tuples and dicts (nested freely);
    "format", "version" and "step" are added. Call on rank 0 only. Returns the path
    written. Raises `CheckpointError` on invalid input or on an `OSError` while
    writing (disk full, read-only, I/O error), in which case every earlier checkpoint is
    untouched and the message names the last good one. `on_write(bytes_written)` is called
    after every write of the checkpoint file; an exception it raises aborts the save (the
    temporary file is removed) and propagates unchanged.
    """
    _validate_state(state, step, keep)
    ckpt_dir = _checkpoint_dir(run_dir)
    final = ckpt_dir / f"step_{step:08d}.pt"
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _remove_temporaries(ckpt_dir)  # left by a save that was killed
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint {final} ({e.strerror or e}); check {ckpt_dir}") from e
    previous = latest_checkpoint(run_dir)
    # Header first so that it reads first in a debugger; caller's format/version are overridden.
    payload = {"format": FORMAT, "version": VERSION, "method": state["method"], "step": step,
               "config": state["config"]}
    payload.update((k, v) for k, v in state.items() if k not in payload)
    renamed = False
    try:
        _atomic_write(final, lambda f: torch.save(payload, f), on_write)
        renamed = True
        _atomic_write(ckpt_dir / LATEST, lambda f: f.write(final.name.encode() + b"\n"))
    except OSError as e:
        # The pointer could not follow: take the new file back so the run is exactly as before
        # (unless it replaced a checkpoint of the same step, which is then the complete new one).
        if renamed and (previous is None or previous.name != final.name):
            try:
                os.unlink(final)
            except OSError:
                pass
        raise CheckpointError(write_failure_message(final, previous, e)) from e
    _prune(ckpt_dir, keep, final)
    return final


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


# ------------------------------------------------------------------ loading
def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(". ")[0]
    return f"{type(e).__name__}: {text}"[:160] if text else type(e).__name__


def _corrupt(path: Path, e: BaseException) -> _CorruptCheckpoint:
    return _CorruptCheckpoint(f"checkpoint {path} is truncated or corrupt ({_short(e)}); use an earlier checkpoint")


def _starts_with(path: Path, prefix: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False


def _load_file(path: Path, map_location: Any) -> Any:
    if path.is_dir():   # a sharded run's checkpoint (torch.distributed.checkpoint)
        from .dcp_checkpoint import load_consolidated

        return load_consolidated(path, map_location)
    try:
        if path.stat().st_size == 0:
            raise _CorruptCheckpoint(f"checkpoint {path} is empty (0 bytes); use an earlier checkpoint")
        return torch.load(path, map_location=map_location, weights_only=True)
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
        raise _corrupt(path, e) from None
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint {path} ({e.strerror or e})") from e
    except Exception as e:  # RuntimeError (zip), EOFError, KeyError, ... from a damaged file
        raise _corrupt(path, e) from None


def _check_header(ckpt: Any, path: Path, expect_method: str | None) -> None:
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        if isinstance(ckpt, dict):
            keys = ", ".join(str(k) for k in list(ckpt)[:4]) + (", ..." if len(ckpt) > 4 else "")
            what = f"a dict with keys {keys}" if ckpt else "an empty dict"
        else:
            what = f"a {type(ckpt).__name__}"
        raise CheckpointError(
            f"{path} is not a unison checkpoint (it holds {what}, no '{FORMAT}' header); "
            "pass a file written by save_checkpoint, or load raw weights with torch.load")
    version = ckpt.get("version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"checkpoint {path} has an invalid format version {version!r}; the file is damaged")
    if version > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, this unison reads up to {VERSION}; upgrade unison")
    bad = [k for k, t in (("method", str), ("step", int), ("config", dict)) if not isinstance(ckpt.get(k), t)]
    if bad:
        raise CheckpointError(
            f"checkpoint {path} has an invalid header ({', '.join(bad)} missing or wrong type); the file is damaged")
    if expect_method is not None and ckpt["method"] != expect_method:
        raise CheckpointError(
            f"checkpoint {path} was written by method '{ckpt['method']}', this run is '{expect_method}'; "
            f"use method '{ckpt['method']}' or a new run directory")


def load_checkpoint(path: str | Path, *, expect_method: str | None = None, map_location: Any = "cpu") -> dict:
    """Load a checkpoint file, or the latest complete checkpoint of a run directory.

    Always ``torch.load(weights_only=True)``. For a run directory, a truncated or
    corrupt latest file is skipped with a warning in favour of the next most recent
    one. Checks the header, and the method if `expect_method` is given. Returns the
    whole dict (header included). Raises `CheckpointError` with a one-line message.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; pass a checkpoint file or a run directory")
    if not path.is_dir() or _STEP_RE.fullmatch(path.name):
        ckpt = _load_file(path, map_location)
        _check_header(ckpt, path, expect_method)
        return ckpt

    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no checkpoint in {_checkpoint_dir(path)}; nothing to resume")
    candidates = [latest] + _newest_first([p for p in list_checkpoints(path) if p != latest], _step_of(latest))
    first_error: CheckpointError | None = None
    for i, candidate in enumerate(candidates):
        try:
            ckpt = _load_file(candidate, map_location)
        except _CorruptCheckpoint as e:
            first_error = first_error or e
            if i + 1 < len(candidates):
                warnings.warn(f"{e}; falling back to {candidates[i + 1].name}", RuntimeWarning, stacklevel=2)
            continue
        _check_header(ckpt, candidate, expect_method)
        return ckpt
    assert first_error is not None
    raise first_error


# ------------------------------------------------------------------ compatibility
def _fmt_shape(shape: torch.Size) -> str:
    return str(tuple(shape))


def check_compatible(model: torch.nn.Module, model_state: dict) -> None:
    """Raise `CheckpointError` unless `model_state` has exactly the model's keys and shapes.

    Call before ``model.load_state_dict(model_state)``: the message names (up to a few)
    missing keys, unexpected keys and shape mismatches on one line.
    """
    if not isinstance(model_state, dict):
        raise CheckpointError(f"model state must be a dict (a state_dict), got {type(model_state).__name__}")
    expected = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    missing = [k for k in expected if k not in model_state]
    unexpected = [k for k in model_state if k not in expected]
    mismatched = [
        f"{'parameter' if k in params else 'buffer'} {k} has shape {_fmt_shape(v.shape)} in the checkpoint "
        f"but {_fmt_shape(expected[k].shape)} in the model"
        for k, v in model_state.items()
        if k in expected and isinstance(v, torch.Tensor) and isinstance(expected[k], torch.Tensor)
        and v.shape != expected[k].shape
    ]
    if not (missing or unexpected or mismatched):
        return

    def few(keys: list[str], what: str) -> str:
        shown = ", ".join(str(k) for k in keys[:3]) + (f", ... ({len(keys) - 3} more)" if len(keys) > 3 else "")
        return f"{len(keys)} {what}{'s' if len(keys) != 1 else ''} ({shown})"

    parts = []
    if missing:
        parts.append(few(missing, "missing key"))
    if unexpected:
        parts.append(few(unexpected, "unexpected key"))
    parts += mismatched[:3]
    if len(mismatched) > 3:
        parts.append(f"{len(mismatched) - 3} more shape mismatches")
    hint = ""
    if unexpected and all(str(k).startswith("module.") for k in model_state):
        hint = "; the checkpoint keys start with 'module.' (a DDP wrapper): save model.module.state_dict()"
    raise CheckpointError("checkpoint does not match the model: " + "; ".join(parts) + hint)


# ------------------------------------------------------------------ RNG state
def pack_rng_state() -> dict:
    """Python `random`, numpy (if importable) and torch CPU (+ CUDA) RNG states, as plain data.

    Arrays are stored as int64 tensors so the result loads with ``weights_only=True``.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        legacy_state = np.random.get_state(legacy=True)
        assert isinstance(legacy_state, tuple)   # legacy=True: the global MT19937's (name, keys, pos, gauss, cached)
        name, keys, pos, has_gauss, cached = legacy_state
        state["numpy"] = {"bit_generator": str(name), "state": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(d: dict) -> None:
    """Restore what `pack_rng_state` saved. Parts this process cannot use are skipped.

    (numpy state without numpy installed, CUDA state without CUDA; CUDA states are
    restored for as many devices as both the checkpoint and this machine have.)
    """
    if not isinstance(d, dict):
        raise CheckpointError(f"RNG state must be the dict from pack_rng_state(), got {type(d).__name__}")
    try:
        if "python" in d:
            py = d["python"]
            random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        if "torch" in d:
            torch.set_rng_state(d["torch"].cpu().to(torch.uint8))
        if "numpy" in d:
            try:
                import numpy as np
            except ImportError:
                pass
            else:
                n = d["numpy"]
                keys = n["state"].cpu().numpy().astype(np.uint32)
                np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
        if "cuda" in d and torch.cuda.is_available():
            states = d["cuda"][: torch.cuda.device_count()]
            for i, s in enumerate(states):
                torch.cuda.set_rng_state(s.cpu().to(torch.uint8), i)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"RNG state is malformed ({_short(e)}); pass the dict from pack_rng_state()") from e
