"""``.dcp`` checkpoints of sharded runs (``--shard full``), written with `torch.distributed.checkpoint` (DCP).

Layout: one directory per checkpoint, beside the ``.pt`` files of unsharded runs::

    RUN_DIR/checkpoints/step_00001200.dcp/
        .metadata                  DCP: which tensor slices are where (written by rank 0)
        __0_0.distcp __1_0.distcp  DCP: each rank's shards of "model" and "optimizer"
        unison.pt                  the header (`header.run_header`, as in a .pt checkpoint: format, version,
                                   method, step, config, extra, resolved recipe, world size, every rank's
                                   RNG state, history) and "sharded": True (rank 0, plain data)
    RUN_DIR/checkpoints/latest     names the newest checkpoint, .pt or .dcp

* **Each rank writes its own shards**; nothing is gathered to one rank. The model and
  optimizer state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``,
  keyed by parameter name (FQN), so a checkpoint loads at any world size and into any
  ``--shard`` setting (`run_state.resume_run`). Rank-local buffers (queues, centres) are saved
  once (rank 0's), as in ``.pt`` checkpoints.
* **Atomic at the directory level.** Every rank writes into ``.step_N.dcp.<token>.tmp/``
  (files fsync'ed by DCP's writer); after all ranks are done, rank 0 writes ``unison.pt``,
  fsyncs the directory, renames it to ``step_N.dcp``, fsyncs ``checkpoints/`` and only then
  moves ``latest``. A kill at any instant leaves the previous checkpoint and ``latest``
  intact; the temporary directory of a killed save is ignored and removed by the next save.
* **Loading never executes pickled code** (`safe_load`: allow-listed metadata, weights-only entries).
* Reading them is `dcp_read`'s (`load_consolidated`, `load_safely`): it needs no training-step types, so the
  teacher of ``--method distill`` reads a ``.dcp`` without an import cycle.

Example::

    save_sharded(run, run_dir, step, history, extra)     # every rank
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from unison.distributed import collectives as C
from unison.errors import CheckpointError

from .files import (
    DCP_HEADER,
    DCP_SUFFIX,
    checkpoint_dir,
    fsync_dir,
    fsync_tree,
    latest_checkpoint,
    point_latest,
    prune,
    remove_checkpoint_dir,
    remove_temporaries,
    write_failure_message,
)
from .header import run_header, validate_state
from .rng_state import pack_rng_state

if TYPE_CHECKING:
    from unison.training.step import Run


def save_sharded(run: Run, run_dir: str | Path, step: int, history: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> Path:
    """Write ``checkpoints/step_{step:08d}.dcp`` (every rank its shards); keep the newest ``keep``. Collective.

    `extra`: what ``run.extra_state.collect()`` returned (rank 0's is saved, as in a ``.pt`` checkpoint)."""
    ckpt_dir = checkpoint_dir(run_dir)
    final = ckpt_dir / f"step_{step:08d}{DCP_SUFFIX}"
    token = C.broadcast_object(secrets.token_hex(4))
    tmp = ckpt_dir / f".{final.name}.{token}.tmp"
    if C.rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_temporaries(ckpt_dir)   # left by a save that was killed
    C.barrier()
    model_state, optim_state = get_state_dict(run.method, run.optimizer)
    rng_states = C.all_gather_object(pack_rng_state())
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=FileSystemWriter(tmp))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"could not write checkpoint {final} ({e}); the previous checkpoint is intact") from e
    if C.rank() == 0:
        header = {**run_header(run, step, history, rng_states, extra), "sharded": True}
        validate_state(header, step, run.cfg.keep_checkpoints)
        _publish(header, tmp, final, ckpt_dir, run_dir)
        prune(ckpt_dir, run.cfg.keep_checkpoints, final)
    C.barrier()
    return final


def _publish(header: dict[str, Any], tmp: Path, final: Path, ckpt_dir: Path, run_dir: str | Path) -> None:
    """Rank 0, once every shard is written: header, fsync, rename `tmp` onto `final`, then ``latest``."""
    try:
        with open(tmp / DCP_HEADER, "wb") as f:
            torch.save(header, f)
        fsync_tree(tmp)
        if final.exists():   # the same step saved again (a resumed run): replace it
            remove_checkpoint_dir(final)
        os.replace(tmp, final)
        fsync_dir(ckpt_dir)
        point_latest(ckpt_dir, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(write_failure_message(final, latest_checkpoint(run_dir), e)) from e
