"""Checkpoints of sharded runs (``--shard full``) with `torch.distributed.checkpoint` (DCP).

Layout: one directory per checkpoint, beside the ``.pt`` files of unsharded runs::

    RUN_DIR/checkpoints/step_00001200.dcp/
        .metadata                  DCP: which tensor slices are where (written by rank 0)
        __0_0.distcp __1_0.distcp  DCP: each rank's shards of "model" and "optimizer"
        unison.pt                  header (format, version, method, step, config), resolved recipe,
                                   world size, every rank's RNG state, history (rank 0, plain data)
    RUN_DIR/checkpoints/latest     names the newest checkpoint, .pt or .dcp

* **Each rank writes its own shards**; nothing is gathered to one rank. The model and
  optimizer state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict``,
  keyed by parameter name (FQN), so a checkpoint loads at any world size and into any
  ``--shard`` setting: DCP reshards DTensors on load, and into an unsharded (DDP or ZeRO-1)
  run it loads full tensors. Rank-local buffers (queues, centres) are saved once (rank 0's),
  as in ``.pt`` checkpoints.
* **Atomic at the directory level.** Every rank writes into ``.step_N.dcp.<token>.tmp/``
  (files fsync'ed by DCP's writer); after all ranks are done, rank 0 writes ``unison.pt``,
  fsyncs the directory, renames it to ``step_N.dcp``, fsyncs ``checkpoints/`` and only then
  moves ``latest``. A kill at any instant leaves the previous checkpoint and ``latest``
  intact; the temporary directory of a killed save is ignored and removed by the next save.
* **Loading never executes pickled code.** DCP's ``.metadata`` is a plain pickle, and DCP
  loads non-tensor entries (optimizer hyper-parameters) with ``torch.load(weights_only=False)``.
  `SafeReader` unpickles ``.metadata`` with an allow-list of DCP's own metadata classes
  (plus ``torch.Size``, dtypes, layouts, paths) and checks that every shard file named in it
  is a plain file inside the checkpoint directory; `SafeLoadPlanner` loads non-tensor entries
  with ``weights_only=True``; tensors are already read with ``weights_only=True`` by DCP.
  ``unison.pt`` is read with ``weights_only=True`` like every unison checkpoint. A file
  that needs anything else is refused with `CheckpointError`.
* `load_consolidated(path)` turns a DCP checkpoint into the dict of a ``.pt`` checkpoint
  (header, full plain ``model`` state dict, RNG, history) in one process without a process
  group: what `unison export` and `unison eval` read (via `load_checkpoint`).

Example::

    save_sharded(run, run_dir, step, history)          # every rank
    step, history = resume_sharded(run, run_dir)        # every rank; any world size, any --shard
    ckpt = load_consolidated("runs/x/checkpoints/step_00000100.dcp")   # one process
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from unison.distributed import collectives as C
from unison.errors import CheckpointError
from unison.optim import constructor_args

from . import checkpoint as ckpt_io

if TYPE_CHECKING:
    from unison.training.step import Run

SUFFIX = ".dcp"
HEADER = "unison.pt"
METADATA = ".metadata"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A DCP checkpoint directory (step_N.dcp)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == SUFFIX or (path / METADATA).is_file())


# ------------------------------------------------------------------ safe loading
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
        raise ckpt_io._corrupt(directory, e) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{directory / METADATA} is not DCP metadata; the checkpoint is damaged")
    for info in (metadata.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", "..") or not (directory / rel).is_file():
            raise CheckpointError(f"{directory / METADATA} names the shard file {rel!r}, which is not a file in "
                                  f"{directory}; the checkpoint is damaged or not unison's")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with an allow-list (DCP uses plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_metadata_safely(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None and hasattr(self, "load_id"):
            storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) loaded with weights_only=True (DCP: False)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"refusing to load {read_item.dest_index.fqn} from a DCP checkpoint: it holds "
                                  "Python objects that could run code when unpickled") from e
        vetted = io.BytesIO()
        torch.save(obj, vetted)   # plain data only now; DefaultLoadPlanner puts it where it belongs
        vetted.seek(0)
        super().load_bytes(read_item, vetted)


def load_safely(state: dict[str, Any], directory: Path) -> None:
    """dcp.load into `state` with `SafeReader` and `SafeLoadPlanner` (collective when a process group exists)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # DCP wraps each rank's error (a BaseException)
            inner = _checkpoint_error_in(e)
            if inner is not None:
                raise inner from None
            raise ckpt_io._corrupt(directory, e) from None


def _checkpoint_error_in(e: BaseException) -> CheckpointError | None:
    """A CheckpointError raised inside DCP (it wraps each rank's failure in its own exception)."""
    seen: list[BaseException] = [e]
    while seen:
        x = seen.pop()
        if isinstance(x, CheckpointError):
            return x
        if isinstance(x, CheckpointException):   # {rank: (exception, traceback)}
            seen.extend(pair[0] for pair in x.failures.values())
        for nxt in (x.__cause__, x.__context__):
            if nxt is not None:
                seen.append(nxt)
    return None


def load_consolidated(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A DCP checkpoint as a ``.pt`` checkpoint dict: header, full plain "model", rng, history. One process."""
    directory = Path(path)
    header = ckpt_io._load_file(directory / HEADER, map_location)
    metadata = read_metadata_safely(directory)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = {fqn[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    state = {"model": model}
    load_safely(state, directory)
    if map_location not in (None, "cpu"):
        state["model"] = {k: v.to(map_location) for k, v in state["model"].items()}
    return {**header, "model": state["model"]} if isinstance(header, dict) else header


# ------------------------------------------------------------------ saving
def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    ckpt_io._fsync_dir(directory)


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted one under its final name:
    renamed to a temporary name first (atomic), then removed (a kill in between leaves a temporary)."""
    doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale(ckpt_dir: Path) -> None:
    """Temporary directories of saves that were killed."""
    for p in ckpt_dir.glob(f".step_*{SUFFIX}.*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def save_sharded(run: Run, run_dir: Path, step: int, history: dict[str, Any]) -> Path:
    """Write ``checkpoints/step_{step:08d}.dcp`` (every rank its shards); keep the newest ``keep``. Collective."""
    ckpt_dir = ckpt_io._checkpoint_dir(run_dir)
    final = ckpt_dir / f"step_{step:08d}{SUFFIX}"
    token = C.broadcast_object(secrets.token_hex(4))
    tmp = ckpt_dir / f".{final.name}.{token}.tmp"
    if C.rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale(ckpt_dir)
    C.barrier()
    model_state, optim_state = get_state_dict(run.method, run.optimizer)
    rng_states = C.all_gather_object(ckpt_io.pack_rng_state())
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=FileSystemWriter(tmp))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"could not write checkpoint {final} ({e}); the previous checkpoint is intact") from e
    if C.rank() == 0:
        header = {"format": ckpt_io.FORMAT, "version": ckpt_io.VERSION, "method": run.cfg.method, "step": step,
                  "config": run.cfg.to_dict(), "resolved": run.resolved, "world_size": C.world_size(),
                  "rng": rng_states, "history": history, "sharded": True}
        ckpt_io._validate_state(header, step, run.cfg.keep_checkpoints)
        try:
            with open(tmp / HEADER, "wb") as f:
                torch.save(header, f)
            _fsync_tree(tmp)
            if final.exists():   # the same step saved again (a resumed run): replace it
                remove_checkpoint_dir(final)
            os.replace(tmp, final)
            ckpt_io._fsync_dir(ckpt_dir)
            def point_latest(f: Any) -> None:
                f.write(final.name.encode() + b"\n")

            ckpt_io._atomic_write(ckpt_dir / ckpt_io.LATEST, point_latest)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(ckpt_io.write_failure_message(final, ckpt_io.latest_checkpoint(run_dir), e)) from e
        ckpt_io._prune(ckpt_dir, run.cfg.keep_checkpoints, final)
    C.barrier()
    return final


# ------------------------------------------------------------------ resuming
def _optimizer_twin(run: Run) -> torch.optim.Optimizer:
    """A plain optimizer over the trainable parameters with the run's hyper-parameters (ZeRO-1 runs load
    the full state into it, then hand it to their sharded optimizer)."""
    local = getattr(run.optimizer, "_optimizer", run.optimizer)
    local = getattr(local, "optim", local)    # ZeroRedundancyOptimizer's local optimizer
    return type(local)(run.trainable, **constructor_args(local))


def resumes_sharded(run: Run, path: str | Path) -> bool:
    """Whether `resume_sharded` loads `path` into `run`: the run is sharded, or the checkpoint is."""
    path = Path(path)
    resolved = path if path.is_file() or is_sharded_checkpoint(path) else ckpt_io.latest_checkpoint(path)
    return run.cfg.distributed.shard == "full" or (resolved is not None and is_sharded_checkpoint(resolved))


def resume_sharded(run: Run, path: str | Path) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint into any run (any world size, any --shard) when either side is sharded. Collective.

    * DCP checkpoint: DCP reads every rank's part (its shards, or the full tensors of an unsharded run).
    * ``.pt`` checkpoint into a ``--shard full`` run: full tensors, each rank keeps its shards.
    """
    from unison.parallel.zero import ShardedOptimizer

    path = Path(path)
    directory = path if is_sharded_checkpoint(path) else ckpt_io.latest_checkpoint(path) or path
    if not is_sharded_checkpoint(directory):
        return _resume_full_from_pt(run, path)
    header = ckpt_io._load_file(directory / HEADER, "cpu")
    ckpt_io._check_header(header, directory, run.cfg.method)
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
    _restore_rng(header)
    return int(header["step"]), dict(header.get("history") or {})


def _resume_full_from_pt(run: Run, path: Path) -> tuple[int, dict[str, Any]]:
    """A ``.pt`` checkpoint (unsharded run) into a ``--shard full`` run."""
    ckpt = ckpt_io.load_checkpoint(path, expect_method=run.cfg.method, map_location=run.device)
    ckpt_io.check_compatible(run.method, ckpt["model"])
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(run.method, ckpt["model"], options=full)
    # .pt optimizer states are keyed by position in the trainable parameters; DCP's by parameter name.
    names = [n for n, p in run.method.named_parameters() if p.requires_grad]
    optim = ckpt["optimizer"]
    by_name: Any = {"state": {names[i]: s for i, s in optim["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}
    set_optimizer_state_dict(run.method, run.optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, strict=False))   # as above
    _restore_rng(ckpt)
    return int(ckpt["step"]), dict(ckpt.get("history") or {})


def _restore_rng(ckpt: dict[str, Any]) -> None:
    rank, world = C.rank(), C.world_size()
    if ckpt.get("rng") is not None and world == ckpt.get("world_size"):
        ckpt_io.restore_rng_state(ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0])
