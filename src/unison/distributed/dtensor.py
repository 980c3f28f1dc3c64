"""DTensor helpers: the few operations unison needs on parameters that FSDP2 has sharded.

Under ``--shard full`` every parameter, its gradient and its optimizer state are
`DTensor`s sharded along dim 0 over the ranks (FSDP2). Code that must see through that:

* `is_sharded(t)`: a DTensor (anything else is a plain, replicated tensor).
* `local_view(t)`: this rank's shard as a plain tensor (in-place changes under ``no_grad``
  reach the DTensor); a plain tensor is returned as is.
* `full_tensor(t)`: the whole tensor on every rank (a collective for DTensors).
* `sum_over_shards_(x, like)`: all-reduce (sum) ``x`` over the ranks `like` is sharded
  over; for per-parameter reductions such as LARS's norms, computed from local shards.
* `assign_full_(param, full)`: write a full-size value into a (possibly sharded) parameter.

torch >= 2.5 exposes DTensor as ``torch.distributed.tensor``; torch 2.4 as the private
``torch.distributed._tensor`` (same classes).

Example::

    sq = local_view(p).pow(2).sum()
    norm = sum_over_shards_(sq, like=p).sqrt()      # ||p|| of the FULL parameter, on every rank
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.distributed as dist

__all__ = ["assign_full_", "full_tensor", "is_sharded", "local_view", "shard_groups", "sum_over_shards_"]


def _dtensor_module() -> ModuleType | None:
    """``torch.distributed.tensor`` (torch 2.4: ``torch.distributed._tensor``) once imported, else None.

    No tensor is a DTensor before that module is imported (FSDP2 imports it before it shards anything), so a
    process that shards nothing (the launcher's parent process, the CLI, ``unison eval``) does not import it."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            return module
    return None


def is_sharded(t: object) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (shares its storage under no_grad), or `t` itself."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: all-gathers a DTensor (call on every rank), returns others as is."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def shard_groups(t: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups of the mesh dimensions `t` is sharded over (empty for a plain tensor)."""
    module = _dtensor_module()
    if module is None or not isinstance(t, module.DTensor):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, p in enumerate(t.placements) if isinstance(p, module.Shard))


@torch.no_grad()
def sum_over_shards_(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum `x` in place over the ranks holding the other shards of `like`; returns `x`."""
    for group in shard_groups(like):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


@torch.no_grad()
def assign_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """param <- full (a full-size value, identical on every rank), whether or not `param` is sharded."""
    module = _dtensor_module()
    if module is not None and isinstance(param, module.DTensor):
        param.copy_(module.distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements))
    else:
        param.copy_(full)
