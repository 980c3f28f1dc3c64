"""Checkpoints of training runs: crash-safe saves, safe loads, exact resumes, clear one-line errors.

Two kinds share one header (`header`), one directory layout and one ``latest`` pointer (`files`):

* ``step_N.pt`` (`pt`): one ``weights_only`` file, written by rank 0, in the background
  (`background.Checkpointer`) so the step loop waits for a snapshot only;
* ``step_N.dcp/`` (`dcp`): a ``--shard full`` run's checkpoint, every rank its own shards
  (``torch.distributed.checkpoint``), readable at any world size and ``--shard``.

Loading never runs code from a file (`safe_load`), and every value read from one is type-checked and bounded
before use, in one place (`contents`, through `header.check_header`; the optimizer state against the optimizer
before it is loaded). `read_header` reads a checkpoint's method, step
and config without its weights (the CLI and the pre-flight checks); `load_checkpoint` reads a whole
checkpoint as a dict (`unison eval`/`export`); `resume_run` puts one into a run (the workers) and
`save_run_checkpoint` writes one (`run_state`), with the extra state (`extra_state`) and every
rank's RNG state (`rng_state`).

Example::

    header = read_header("runs/x")                       # method, step, config; no weights read
    ckpt = load_checkpoint("runs/x", expect_method="moco")
    check_compatible(model, ckpt["model"])
"""

from typing import TYPE_CHECKING, Any

from .background import Checkpointer, SaveAborted, snapshot
from .compat import check_compatible
from .extra_state import ExtraState, Stateful
from .files import (
    CHECKPOINT_DIR,
    LATEST,
    is_sharded_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    write_failure_message,
)

if TYPE_CHECKING:   # for annotations and mypy; at run time `__getattr__` imports them
    from .dcp import save_sharded
    from .dcp_read import load_consolidated, load_safely
    from .header import FORMAT, VERSION, CheckpointHeader, read_header
    from .pt import load_checkpoint, save_checkpoint
    from .rng_state import pack_rng_state, restore_rng_state, restore_run_rng
    from .run_state import resume_run, resume_sharded, resumes_sharded, save_run_checkpoint
    from .safe_load import read_metadata_safely

# Imported on first use (what a run does before it saves or reads a checkpoint needs none of them): the header, the
# readers and the run's state, each name from its module; torch.distributed.checkpoint (with DTensor), which
# ``--shard full`` needs, is a slow import, which the launcher's parent process, the CLI and ``unison eval`` of a
# ``.pt`` need not pay (a DDP worker imports it anyway: DDP's constructor imports torch._dynamo, which imports them).
_LAZY = {**dict.fromkeys(("FORMAT", "VERSION", "CheckpointHeader", "read_header"), "header"),
         **dict.fromkeys(("load_checkpoint", "save_checkpoint"), "pt"),
         **dict.fromkeys(("pack_rng_state", "restore_rng_state", "restore_run_rng"), "rng_state"),
         **dict.fromkeys(("resume_run", "resume_sharded", "resumes_sharded", "save_run_checkpoint"), "run_state"),
         "read_metadata_safely": "safe_load", "save_sharded": "dcp", "load_consolidated": "dcp_read",
         "load_safely": "dcp_read"}


def __getattr__(name: str) -> Any:
    """The names of `_LAZY`, each imported from its module on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_DIR", "FORMAT", "LATEST", "VERSION", "CheckpointHeader", "Checkpointer", "ExtraState", "SaveAborted",
    "Stateful", "check_compatible", "is_sharded_checkpoint", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "load_consolidated", "load_safely", "pack_rng_state", "read_header", "read_metadata_safely",
    "restore_rng_state", "restore_run_rng", "resume_run", "resume_sharded", "resumes_sharded", "save_checkpoint",
    "save_run_checkpoint", "save_sharded", "snapshot", "write_failure_message",
]
