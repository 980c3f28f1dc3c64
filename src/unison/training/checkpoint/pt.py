"""``.pt`` checkpoints: one crash-safe file per saved step, and loading any checkpoint as such a dict.

Guarantees
----------
* **Atomic.** A checkpoint is serialised to a temporary file in the same directory,
  flushed and fsync'ed, then `os.replace`d onto its final name and the directory is
  fsync'ed; `latest` is replaced the same way afterwards (`files.atomic_write`). A kill at
  any instant leaves the previous complete checkpoint loadable and `latest_checkpoint`
  pointing to a complete file.
* **Disk full, read-only or failing filesystem.** An `OSError` while saving (ENOSPC, EDQUOT,
  EROFS, EIO from write or fsync) removes the temporary file, keeps every earlier checkpoint
  and raises `CheckpointError` naming the last good checkpoint. torch's zip writer turns a
  failed or short write into ``RuntimeError: unexpected pos ...``; the real `OSError` is raised instead.
* **Safe to load.** ``torch.load(weights_only=True)`` only (`safe_load`).
* **Self-describing.** Every checkpoint starts with the header (`header.make_header`) and goes on
  with the caller's entries (model, optimizer, queues, schedule, RNG, ...).

Only rank 0 may call `save_checkpoint` (one writer per run directory): that is the
caller's business. Every rank may call `load_checkpoint`, which also reads a ``.dcp`` directory
(consolidated into one process: `dcp_read.load_consolidated`), so `unison eval`/`export` read both kinds.

Example::

    state = {"method": "moco", "config": cfg.to_dict(), "model": model.state_dict(),
             "optimizer": opt.state_dict(), "rng": pack_rng_state()}
    if rank() == 0:
        save_checkpoint(run_dir, state, step=step, keep=3)

    ckpt = load_checkpoint(run_dir, expect_method="moco")   # latest complete checkpoint
    check_compatible(model, ckpt["model"])
    model.load_state_dict(ckpt["model"])
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unison.errors import CheckpointError

from .files import (
    atomic_write,
    checkpoint_dir,
    first_loadable,
    is_checkpoint_name,
    latest_checkpoint,
    named_checkpoint,
    point_latest,
    prune,
    remove_temporaries,
    write_failure_message,
)
from .header import Expected, check_header, make_header, validate_state
from .safe_load import load_file


def save_checkpoint(run_dir: str | Path, state: dict, step: int, keep: int = 3,
                    on_write: Callable[[int], None] | None = None) -> Path:
    """Atomically write `state` as ``RUN_DIR/checkpoints/step_{step:08d}.pt``; keep the newest `keep`.

    The newest are this one and the highest steps below it; checkpoints of higher steps
    (left before the run was resumed from an earlier one) are pruned first.

    `state` must contain "method" (str) and "config" (plain dict) and otherwise only
    tensors, numbers, strings, bools, None, lists, tuples and dicts (nested freely);
    the header ("format", "version", "step", "extra" if absent) is added. Call on rank 0 only.
    Returns the path written. Raises `CheckpointError` on invalid input or on an `OSError` while
    writing (disk full, read-only, I/O error), in which case every earlier checkpoint is
    untouched and the message names the last good one. `on_write(bytes_written)` is called
    after every write of the checkpoint file; an exception it raises aborts the save (the
    temporary file is removed) and propagates unchanged.
    """
    validate_state(state, step, keep)
    ckpt_dir = checkpoint_dir(run_dir)
    final = ckpt_dir / f"step_{step:08d}.pt"
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_temporaries(ckpt_dir)  # left by a save that was killed
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint {final} ({e.strerror or e}); check {ckpt_dir}") from e
    previous = latest_checkpoint(run_dir)
    payload = make_header(state, step)
    renamed = False
    try:
        atomic_write(final, lambda f: torch.save(payload, f), on_write)
        renamed = True
        point_latest(ckpt_dir, final)
    except OSError as e:
        # The pointer could not follow: take the new file back so the run is exactly as before
        # (unless it replaced a checkpoint of the same step, which is then the complete new one).
        if renamed and (previous is None or previous.name != final.name):
            try:
                os.unlink(final)
            except OSError:
                pass
        raise CheckpointError(write_failure_message(final, previous, e)) from e
    prune(ckpt_dir, keep, final)
    return final


def _load_one(path: Path, map_location: Any, expect_method: Expected, run: bool) -> dict:
    # A directory is a sharded run's checkpoint (torch.distributed.checkpoint), consolidated here.
    if path.is_dir():   # a --shard full checkpoint: torch.distributed.checkpoint is imported when one is read
        from .dcp_read import load_consolidated

        ckpt = load_consolidated(path, map_location)
    else:
        ckpt = load_file(path, map_location)
    check_header(ckpt, path, expect_method, run)
    return ckpt


def load_checkpoint(path: str | Path, *, expect_method: Expected = None, map_location: Any = "cpu",
                    run: bool = False) -> dict:
    """Load a checkpoint file (or ``.dcp`` directory), or the latest complete checkpoint of a run directory.

    Always ``torch.load(weights_only=True)``. For a run directory, a truncated or
    corrupt latest file is skipped with a warning in favour of the next most recent
    one. Checks the header, and the method (or the method and model structure, `header.structure`) if
    `expect_method` is given; `run`: a training run's checkpoint,
    whose every field is checked as a run reads it (`contents.check_run_fields`). Returns the
    whole dict (header included). Raises `CheckpointError` with a one-line message.
    To read only method, step and config, use `read_header` (no weights are read).
    """
    path = named_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; pass a checkpoint file or a run directory")
    if not path.is_dir() or is_checkpoint_name(path):
        return _load_one(path, map_location, expect_method, run)
    return first_loadable(path, lambda candidate: _load_one(candidate, map_location, expect_method, run))
