"""Named training state beyond model and optimizer, saved in every checkpoint: the plug-in point.

A `Run` holds an `ExtraState`: a registry of named components, each an object with
``state_dict() -> dict`` and ``load_state_dict(dict)`` (torch's ``Stateful`` protocol). What
changes training after a resume and is neither a parameter, a buffer nor optimizer state
registers here, and `save_run_checkpoint` / `resume_run` carry it (``.pt`` and ``.dcp`` checkpoints
alike) without further changes:

    run.extra_state.register("grad_scaler", run.scaler)                   # fp16 loss scale (same on every rank)
    run.extra_state.register("powersgd", powersgd, per_rank=True)         # error feedback differs per rank
    run.extra_state.register("loader", streaming_source)                  # position inside an epoch
    run.extra_state.register("fsdp", sharded_state)                       # e.g. a full state dict via DCP

Semantics
---------
* ``state_dict()`` is called on **every rank** at every checkpoint (it may be collective, e.g.
  consolidating sharded state with ``torch.distributed.checkpoint.state_dict.get_state_dict``).
  For a global component (default) rank 0's result is saved; for a ``per_rank`` component
  every rank's result is gathered to rank 0 and saved as a list indexed by rank.
* ``load_state_dict(state)`` is called on every rank on resume. A per-rank component gets its
  own rank's state when the world size is unchanged; at another world size it is not loaded
  and a warning says so (its ``reset_for_world_size(old, new)`` is called if it has one).
* The returned dicts must hold plain data only (tensors, numbers, strings, bools, None, lists,
  tuples, dicts): checkpoints load with ``weights_only=True`` and never run code.
* A component missing from an older checkpoint starts fresh, with a warning; a saved component
  that this run did not register is ignored, with a warning.

The checkpoint holds ``ckpt["extra"] = {name: {"per_rank": bool, "world_size": W, "state": ...}}``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from unison.distributed import collectives as C
from unison.errors import CheckpointError


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def extra_problem(saved: Any) -> str | None:
    """What is wrong with a checkpoint's ``extra`` entry (None: nothing): its shape, before any component loads it."""
    if saved is None:
        return None
    if not isinstance(saved, dict) or len(saved) > 1000:
        return f"{type(saved).__name__}, not a dict of named components"
    for name, entry in saved.items():
        label = repr(name) if isinstance(name, str) and len(name) <= 64 else "a component"
        if not (isinstance(name, str) and len(name) <= 64):
            return f"{label} has no short name"
        if not isinstance(entry, dict) or "state" not in entry or type(entry.get("per_rank")) is not bool:
            return f"{label} is not a dict with 'per_rank' and 'state'"
        world = entry.get("world_size")
        if type(world) is not int or not 1 <= world <= 2**20:
            return f"{label} has world_size {str(world)[:20]}, not an integer from 1 to 2**20"
        if entry["per_rank"] and (type(entry["state"]) not in (list, tuple) or len(entry["state"]) != world):
            return f"{label} is per rank but does not hold one state for each of its {world} ranks"
    return None


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class _Component:
    obj: Stateful
    per_rank: bool


class ExtraState:
    """Registry of named `Stateful` components carried by every checkpoint of a run."""

    def __init__(self) -> None:
        self._components: dict[str, _Component] = {}

    def register(self, name: str, obj: Stateful, *, per_rank: bool = False) -> None:
        if not isinstance(obj, Stateful):
            raise TypeError(f"extra state {name!r} must have state_dict() and load_state_dict(state)")
        if name in self._components:
            raise ValueError(f"extra state {name!r} is already registered")
        self._components[name] = _Component(obj, per_rank)

    def names(self) -> list[str]:
        return list(self._components)

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def collect(self) -> dict[str, Any]:
        """Every rank calls this; rank 0 gets what the checkpoint stores (other ranks: an empty dict)."""
        out: dict[str, Any] = {}
        world = C.world_size()
        for name, comp in self._components.items():
            state = comp.obj.state_dict()
            if comp.per_rank:
                states = C.gather_object_to_rank0(_to_cpu(state))
                out[name] = {"per_rank": True, "world_size": world, "state": states}
            else:
                out[name] = {"per_rank": False, "world_size": world, "state": state}
        return out if C.rank() == 0 else {}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Load every registered component from a checkpoint's ``extra`` entry (every rank calls this)."""
        problem = extra_problem(saved)
        if problem:
            raise CheckpointError(f"the checkpoint's extra state is malformed ({problem}); the file is damaged")
        saved = dict(saved or {})
        rank, world = C.rank(), C.world_size()
        for name, comp in self._components.items():
            entry = saved.pop(name, None)
            if entry is None:
                if rank == 0:
                    warnings.warn(f"the checkpoint has no {name!r} state (an older checkpoint); it starts fresh",
                                  RuntimeWarning, stacklevel=2)
                continue
            if entry["per_rank"]:
                old_world = entry["world_size"]
                if old_world != world:
                    reset = getattr(comp.obj, "reset_for_world_size", None)
                    if reset is not None:
                        reset(old_world, world)
                    if rank == 0:
                        warnings.warn(f"{name!r} state is per rank and was saved at world size {old_world}, this run "
                                      f"has {world}: it starts fresh", RuntimeWarning, stacklevel=2)
                    continue
                _load(name, comp.obj, entry["state"][rank])
            else:
                _load(name, comp.obj, entry["state"])
        if saved and rank == 0:
            warnings.warn(f"the checkpoint holds state this run does not use ({', '.join(sorted(saved))}); "
                          "it is ignored", RuntimeWarning, stacklevel=2)


def _load(name: str, obj: Stateful, state: Any) -> None:
    """A component's own ``load_state_dict``; what it raises on a state it cannot take becomes one line."""
    try:
        obj.load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        text = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        raise CheckpointError(f"the checkpoint's extra state {name!r} does not fit this run ({type(e).__name__}: "
                              f"{text}); the file is damaged or from other options") from None
