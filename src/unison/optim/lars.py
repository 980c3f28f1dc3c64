"""LARS (You et al., 2017) as in the SimCLR / BYOL / Barlow Twins recipes, exact on sharded parameters.

For each parameter p with gradient g, when adaptation applies (always, or only for
``p.ndim > 1`` with ``exclude_bias_and_norm=True``)::

    u = g + weight_decay * p
    trust = eta * ||p|| / ||u||   if ||p|| > 0 and ||u|| > 0   else 1
    u = trust * u

otherwise ``u = g`` (biases and norm weights get neither weight decay nor adaptation).
Then ``mu = momentum * mu + u`` and ``p -= lr * mu``.

Sharded parameters (``--shard full``: FSDP2 DTensors, each rank holding a slice of dim 0):
the trust ratio needs the norms of the FULL parameter and update, not of the local slices
(the classic bug: every rank would then scale its slice by a different, wrong ratio). Each
rank sums the squares of its slices, one all-reduce per step sums them over the shards of
all parameters at once, and ||p|| = sqrt of the sum; the update itself is elementwise and
applied to the local slices. The momentum buffer has the parameter's type (a DTensor with
the same sharding), so `torch.distributed.checkpoint` can reshard it to another world size.
For plain tensors the norms are plain ``torch.linalg.vector_norm`` calls.

Hand-written because torch has no LARS and the packaged ones (e.g. in lightly, solo-learn)
compute ``torch.norm`` of whatever tensor they are given, which is the local-slice bug under
FSDP.

Example::

    opt = LARS(model.parameters(), lr=0.3, weight_decay=1e-6)
    loss.backward(); opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from unison.distributed.dtensor import is_sharded, local_view, shard_groups, sum_over_shards_


class LARS(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 1e-6,
                 eta: float = 0.001, exclude_bias_and_norm: bool = True) -> None:
        if not lr >= 0:
            raise ValueError(f"LARS lr={lr!r} must be >= 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"LARS momentum={momentum!r} must be in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"LARS weight_decay={weight_decay!r} must be >= 0")
        if not eta > 0:
            raise ValueError(f"LARS eta={eta!r} (trust coefficient) must be > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      exclude_bias_and_norm=exclude_bias_and_norm))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = [self._update(p, group) for p in params]
            adapted = [i for i, p in enumerate(params) if not (group["exclude_bias_and_norm"] and p.ndim <= 1)]
            norms = _full_norms([params[i] for i in adapted], [updates[i] for i in adapted])
            for i, (p_norm, u_norm) in zip(adapted, norms):
                # torch.where instead of `if`: no host sync on accelerators.
                trust = torch.where((p_norm > 0) & (u_norm > 0), group["eta"] * p_norm / u_norm,
                                    torch.ones_like(p_norm))
                updates[i] = updates[i] * trust
            for p, update in zip(params, updates):
                if group["momentum"] != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # mu_0 = 0
                    buf = local_view(state["momentum_buffer"])
                    buf.mul_(group["momentum"]).add_(update)
                    update = buf
                local_view(p).add_(update, alpha=-group["lr"])
        return loss

    @staticmethod
    def _update(p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """This rank's part of g (+ weight decay when adapted), as a plain tensor."""
        assert p.grad is not None   # the caller passes parameters with gradients only
        if p.grad.is_sparse:
            raise TypeError("LARS does not support sparse gradients")
        g = local_view(p.grad)
        if group["exclude_bias_and_norm"] and p.ndim <= 1:
            return g
        return g.add(local_view(p), alpha=group["weight_decay"])


def _full_norms(params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(||p||, ||u||) of every FULL parameter and update; `updates` are local slices of sharded ones."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(params)
    sharded: dict[tuple, list[int]] = {}
    for i, (p, u) in enumerate(zip(params, updates)):
        if is_sharded(p):
            sharded.setdefault(tuple(id(g) for g in shard_groups(p)), []).append(i)
        else:
            out[i] = (torch.linalg.vector_norm(p), torch.linalg.vector_norm(u))
    for indices in sharded.values():   # one all-reduce per mesh: squared norms of every slice at once
        sq = torch.stack([torch.stack([local_view(params[i]).pow(2).sum(), updates[i].pow(2).sum()])
                          for i in indices])
        sum_over_shards_(sq, like=params[indices[0]])
        for row, i in zip(sq.sqrt(), indices):
            out[i] = (row[0], row[1])
    return out  # type: ignore[return-value]
