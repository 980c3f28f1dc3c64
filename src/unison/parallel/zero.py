"""ZeRO-1 for the training step (``--shard optimizer``): optimizer state sharded across ranks.

`ShardedOptimizer(params, torch.optim.AdamW, lr=...)` wraps
``torch.distributed.optim.ZeroRedundancyOptimizer`` (works on gloo): parameters are
assigned whole to ranks (largest first, to the least loaded rank); each rank keeps the
optimizer state of the parameters it owns, steps those, and broadcasts them, so every
replica stays identical. The model is in DDP, which averages the gradients. Without a
process group (one process) it is a plain ``optimizer_class`` with the same API.

Checkpoints: ``state_dict()`` is a collective that consolidates the full state on rank 0
only (every rank must call it; only rank 0 writes the checkpoint): rank 0 gets the format of
an unsharded ``optimizer_class`` state dict, which loads into a `ShardedOptimizer` at any
world size or into a plain optimizer; the other ranks get ``{}``.

To shard parameters and gradients as well, use ``--shard full`` (FSDP2,
`unison.parallel.fsdp`). Gradient averaging without DDP and local SGD are not part of the
training step: use DDP, and torch's ``PostLocalSGDOptimizer``
(``torch.distributed.optim``) for local SGD.

Example::

    opt = ShardedOptimizer(ddp_model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step()
    state = opt.state_dict()                  # every rank calls it
    if rank == 0:
        torch.save(state, "opt.pt")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["ShardedOptimizer"]


def _params_of(groups: Iterable[Any]) -> list[torch.Tensor]:
    groups = list(groups)
    if groups and isinstance(groups[0], dict):
        return [p for g in groups for p in g["params"]]
    return groups


def tensor_identity(t: torch.Tensor) -> tuple[int, int, int]:
    """What makes two tensors the same memory: their storage (by its C++ identity, which fake tensors, whose
    data pointers are all 0, have too), offset and size."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return int(StorageWeakRef(t.untyped_storage()).cdata), int(t.storage_offset()), int(t.numel())


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`, aliased ones (the same `tensor_identity`) counted once."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for t in tensors:
        if tensor_identity(t) not in seen:
            seen.add(tensor_identity(t))
            total += t.numel() * t.element_size()
    return total


def _state_bytes(*states: dict[Any, Any]) -> int:
    # ZeroRedundancyOptimizer stores None for parameters other ranks own
    return unique_bytes(v for state in states for per_param in state.values() if isinstance(per_param, dict)
                        for v in per_param.values() if isinstance(v, torch.Tensor))


class ShardedOptimizer(Optimizer):
    """ZeRO-1: each rank keeps optimizer state only for the parameters it owns.

    Subclasses ``Optimizer`` (so LR schedulers accept it) without calling its ``__init__``:
    ``param_groups`` and ``state`` are those of the wrapped optimizer.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"ShardedOptimizer needs an optimizer class such as torch.optim.AdamW, got "
                            f"{optimizer_class!r}")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise TypeError("ShardedOptimizer cannot use LBFGS: its closure re-evaluates the loss during a line search")
        params = list(params)
        if not any(p.requires_grad for p in _params_of(params)):
            raise ValueError("ShardedOptimizer got no parameter with requires_grad=True; pass the trainable parameters")
        self._sharded = dist.is_available() and dist.is_initialized()
        if self._sharded:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self._optimizer: Optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        else:
            self._optimizer = optimizer_class(params, **defaults)
            self._rank, self._world_size = 0, 1

    # ---- the wrapped optimizer's state, proxied
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups   # a property: Optimizer.load_state_dict replaces the list

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self) -> dict[str, Any]:  # Optimizer's version assumes its own attributes
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ShardedOptimizer(rank={self._rank}, world_size={self._world_size}, {self._optimizer!r})"

    # ---- ZeRO-1
    def _zero(self) -> ZeroRedundancyOptimizer:
        """The wrapped optimizer as the ZeroRedundancyOptimizer it is when ``self._sharded``."""
        return cast("ZeroRedundancyOptimizer", self._optimizer)

    @property
    def sharding(self) -> dict[str, Any]:
        """Which parameters (indices into the flattened param groups) each rank owns.

        ``{"world_size": W, "owner": [rank of parameter i], "params_per_rank": [[i, ...], ...],
        "numel_per_rank": [elements owned by each rank]}``.
        """
        params = _params_of(self.param_groups)
        if self._sharded:
            # Private but stable since torch 1.8 (no public query); torch's .pyi stub omits this property.
            to_rank = self._zero()._param_to_rank  # type: ignore[attr-defined]
            owner = [to_rank[p] for p in params]
        else:
            owner = [0] * len(params)
        per_rank = [[i for i, o in enumerate(owner) if o == r] for r in range(self._world_size)]
        return {"world_size": self._world_size, "owner": owner, "params_per_rank": per_rank,
                "numel_per_rank": [sum(params[i].numel() for i in idx) for idx in per_rank]}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def state_dict(self) -> dict[str, Any]:
        """The full (consolidated) optimizer state on rank 0, ``{}`` on the others. Collective."""
        if not self._sharded:
            return self._optimizer.state_dict()
        self._zero().consolidate_state_dict(to=0)
        return self._optimizer.state_dict() if self._rank == 0 else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` at any world size); keep only the local shard."""
        if not self._sharded:
            self._optimizer.load_state_dict(state_dict)
            return
        # ZeroRedundancyOptimizer overwrites other ranks' entries of the dict it is given.
        self._optimizer.load_state_dict({**state_dict, "state": dict(state_dict["state"])})
        # Its base class also keeps a second copy of the local shard in its own `state`,
        # which nothing reads (the local optimizer has the live one): drop it.
        self._optimizer.state.clear()

    def local_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held by this rank."""
        if not self._sharded:
            return _state_bytes(self._optimizer.state)
        return _state_bytes(self._zero().optim.state, self._optimizer.state)
