"""Reading ``.dcp`` checkpoints (`unison.training.checkpoint.dcp` writes them), safely: no pickled code runs.

* `load_consolidated(path)` turns a DCP checkpoint into the dict of a ``.pt`` checkpoint (header, full plain
  ``model`` state dict, RNG, history): in one process without a process group (what `unison export` and
  `unison eval` read, via `load_checkpoint`), or collectively by every worker of a run (a ``--teacher``).
* `load_safely(state, directory)`: ``dcp.load`` with allow-listed metadata and weights-only entries.

Apart from the writer, which needs the training step's `Run`: this module imports nothing of the training
layer but the checkpoint files' helpers, so the distill teacher (imported by the step) can read a ``.dcp``.

Example::

    ckpt = load_consolidated("runs/x/checkpoints/step_00000100.dcp")
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader

from unison.errors import CheckpointError

from .files import DCP_HEADER
from .safe_load import corrupt, load_file, read_metadata_safely


def load_consolidated(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A DCP checkpoint as a ``.pt`` checkpoint dict: header, full plain "model", rng, history. One process."""
    directory = Path(path)
    header = load_file(directory / DCP_HEADER, map_location)
    metadata = read_metadata_safely(directory)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # on the CPU whatever device context the caller is in (the memory estimate builds under "meta")
    model = {fqn[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu")
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    state = {"model": model}
    load_safely(state, directory)
    if map_location not in (None, "cpu"):
        state["model"] = {k: v.to(map_location) for k, v in state["model"].items()}
    return {**header, "model": state["model"]} if isinstance(header, dict) else header


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with the allow-list (DCP uses plain pickle)."""

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
            raise corrupt(directory, e) from None


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
