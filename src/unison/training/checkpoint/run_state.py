"""A training run's checkpoint: what `save_run_checkpoint` writes and how `resume_run` puts it back.

Both kinds carry the same header (`header.run_header`): method, step, config, extra state, resolved
recipe, world size, every rank's RNG state and the metric history. An unsharded run writes a ``.pt``
file from rank 0 (in the background: `background.Checkpointer`); a ``--shard full`` run writes a
``.dcp`` directory, every rank its shards (`dcp.save_sharded`).

`resume_run` loads any checkpoint into any run (any world size, any ``--shard``) and reads the
checkpoint's full state once: a ``.pt`` file into an unsharded run directly; a ``.dcp`` directory, or
a ``.pt`` file into a sharded run, through ``torch.distributed.checkpoint.state_dict`` (keyed by
parameter name, resharded on load). Model, optimizer, extra state and (at the same world size) every
rank's RNG state are restored the same way for all of them (`_restore_rest`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.distributed import collectives as C
from unison.errors import CheckpointError
from unison.optim import constructor_args

from .background import Checkpointer
from .compat import check_compatible
from .contents import check_optimizer_state, check_step_in_run
from .files import DCP_HEADER, is_sharded_checkpoint, latest_checkpoint
from .header import check_header, run_header, structure
from .pt import load_checkpoint
from .rng_state import pack_rng_state, restore_run_rng
from .safe_load import load_file, read_metadata_safely

# torch.distributed.checkpoint (and the DTensor machinery it imports, a slow import) is imported by the functions of
# --shard full runs only: the launcher's parent process imports this module and never needs it.

if TYPE_CHECKING:
    from unison.training.step import Run


# ------------------------------------------------------------------ saving
def save_run_checkpoint(run: Run, checkpointer: Checkpointer, step: int, history: dict[str, Any]) -> None:
    """Every rank takes part (sharded optimizer state, RNG states and per-rank extra state are collected);
    rank 0 writes, in the background when the checkpointer is asynchronous (it waits for a snapshot only).
    How long the step loop was held up is appended to ``checkpointer.wait_s``. Under ``--shard full`` every
    rank writes its own shards with torch.distributed.checkpoint (synchronously)."""
    started = time.perf_counter()
    if run.cfg.distributed.shard == "full":
        from .dcp import save_sharded

        save_sharded(run, checkpointer.run_dir, step, history, run.extra_state.collect())
        checkpointer.wait_s.append(time.perf_counter() - started)
        return
    optim_state = run.optimizer.state_dict()   # collective when sharded: every rank calls it
    rng_states = C.all_gather_object(pack_rng_state())
    extra = run.extra_state.collect()          # GradScaler, PowerSGD error feedback, ... (may be collective)
    if C.rank() == 0:
        state = {**run_header(run, step, history, rng_states, extra), "model": run.method.state_dict(),
                 "optimizer": optim_state}
        checkpointer.save(state, step)
    C.barrier()
    checkpointer.wait_s.append(time.perf_counter() - started)


# ------------------------------------------------------------------ resuming
def resume_run(run: Run, path: str | Path) -> tuple[int, dict[str, Any]]:
    """Load model, optimizer, extra state and (at the same world size) RNG state; return (step, history).

    `path`: a checkpoint file, a ``.dcp`` directory or a run directory (its latest checkpoint). Collective
    when either the run or the checkpoint is sharded."""
    if resumes_sharded(run, path):   # a sharded run, or a sharded run's checkpoint: any world size, any --shard
        return resume_sharded(run, path)
    ckpt = _load_run_checkpoint(run, path)
    run.method.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    return _restore_rest(run, ckpt)


def _load_run_checkpoint(run: Run, path: str | Path) -> dict[str, Any]:
    """A ``.pt`` checkpoint, every field checked against this run (step, model, optimizer) before anything loads."""
    ckpt = load_checkpoint(path, expect_method=structure(run.cfg), map_location=run.device, run=True)
    check_step_in_run(ckpt["step"], run.total_steps, path)
    check_compatible(run.method, ckpt.get("model"), path)
    check_optimizer_state(run.optimizer, ckpt.get("optimizer"), path)
    return ckpt


def _restore_rest(run: Run, ckpt: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """What every kind of resume restores after model and optimizer: extra state, RNG; (step, history)."""
    run.extra_state.restore(ckpt.get("extra"))
    restore_run_rng(ckpt)
    saved = ckpt.get("resolved") or {}
    if "init" in saved and "init" not in run.resolved:   # --init: the weights it started from, recorded on
        run.resolved["init"] = saved["init"]
    if isinstance(saved.get("run_id"), str):   # the run it continues (the loop gives a branch an id of its own)
        run.resolved["run_id"] = saved["run_id"]
    planned = saved.get("total_steps")
    if isinstance(planned, int) and planned != run.total_steps:   # the loop says so: the schedules follow this run
        run.resolved["resumed_from_total_steps"] = planned
    return int(ckpt["step"]), dict(ckpt.get("history") or {})


def resumes_sharded(run: Run, path: str | Path) -> bool:
    """Whether `resume_sharded` loads `path` into `run`: the run is sharded, or the checkpoint is."""
    path = Path(path)
    resolved = path if path.is_file() or is_sharded_checkpoint(path) else latest_checkpoint(path)
    return run.cfg.distributed.shard == "full" or (resolved is not None and is_sharded_checkpoint(resolved))


def resume_sharded(run: Run, path: str | Path) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint into any run (any world size, any --shard) when either side is sharded. Collective.

    * DCP checkpoint: DCP reads every rank's part (its shards, or the full tensors of an unsharded run).
    * ``.pt`` checkpoint into a ``--shard full`` run: full tensors, each rank keeps its shards.
    """
    path = Path(path)
    directory = path if is_sharded_checkpoint(path) else latest_checkpoint(path) or path
    if not is_sharded_checkpoint(directory):
        return _resume_full_from_pt(run, path)
    header = load_file(directory / DCP_HEADER, "cpu")
    check_header(header, directory, structure(run.cfg), run=True)
    check_step_in_run(header["step"], run.total_steps, directory)
    _load_dcp_into(run, directory)
    return _restore_rest(run, header)


def _optimizer_twin(run: Run) -> torch.optim.Optimizer:
    """A plain optimizer over the trainable parameters with the run's hyper-parameters (ZeRO-1 runs load
    the full state into it, then hand it to their sharded optimizer)."""
    local = getattr(run.optimizer, "_optimizer", run.optimizer)
    local = getattr(local, "optim", local)    # ZeroRedundancyOptimizer's local optimizer
    return type(local)(run.trainable, **constructor_args(local))


def _load_dcp_into(run: Run, directory: Path) -> None:
    """Model and optimizer state of the DCP checkpoint `directory` into `run` (every rank its part)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from unison.parallel.zero import ShardedOptimizer

    from .dcp_read import load_safely

    optimizer = _optimizer_twin(run) if isinstance(run.optimizer, ShardedOptimizer) else run.optimizer
    model_state: Any
    optim_state: Any
    model_state, optim_state = get_state_dict(run.method, optimizer)
    expected = set(model_state)
    keys = read_metadata_safely(directory).state_dict_metadata
    # get_state_dict gives every trainable parameter a state (a zero-gradient step); parameters that never
    # had a gradient (a frozen teacher's batch-norm weights) have none in the checkpoint, nor in the run.
    with_state = {k.split(".", 2)[2] for k in keys if k.startswith("optimizer.state.")}
    optim_state["state"] = {fqn: s for fqn, s in optim_state["state"].items()
                            if any(f"{fqn}.{name}" in with_state for name in s)}
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    saved = {k[len("model."):] for k in keys if k.startswith("model.")}
    if saved != expected:
        missing, unexpected = sorted(expected - saved), sorted(saved - expected)
        raise CheckpointError(f"checkpoint {directory} does not match the model: {len(missing)} missing key(s) "
                              f"{missing[:3]}, {len(unexpected)} unexpected key(s) {unexpected[:3]}")
    load_safely(state, directory)
    set_model_state_dict(run.method, state["model"])
    # strict=False: the stateless parameters above, left without state as in the saved run
    set_optimizer_state_dict(run.method, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    if optimizer is not run.optimizer:
        run.optimizer.load_state_dict(optimizer.state_dict())


def _resume_full_from_pt(run: Run, path: Path) -> tuple[int, dict[str, Any]]:
    """A ``.pt`` checkpoint (unsharded run) into a ``--shard full`` run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    ckpt = _load_run_checkpoint(run, path)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(run.method, ckpt["model"], options=full)
    # .pt optimizer states are keyed by position in the trainable parameters; DCP's by parameter name.
    names = [n for n, p in run.method.named_parameters() if p.requires_grad]
    optim = ckpt["optimizer"]
    by_name: Any = {"state": {names[i]: s for i, s in optim["state"].items()},
                    "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}
    set_optimizer_state_dict(run.method, run.optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, strict=False))   # as above
    return _restore_rest(run, ckpt)
