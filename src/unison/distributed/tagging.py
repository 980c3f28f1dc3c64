"""Rank-local tagging: the buffers and parameters that every rank keeps for itself.

DDP broadcasts rank 0's buffers before every forward and FSDP2 shards parameters; queues, centres, step counters
and momentum encoders must be neither (field notes, section 4). A module marks them with
`mark_rank_local_state`, and the parallel wiring (`unison.parallel`) reads the marks with
`rank_local_state_names`. Losses and methods import this module only, never the wiring itself.

Example::

    class Queue(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("queue", torch.zeros(4096, 128))
            mark_rank_local_state(self, ["queue"])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

_STATE_ATTR = "_unison_rank_local_state"


def mark_rank_local_state(module: nn.Module, names: Iterable[str] | None = None) -> None:
    """Exclude `module`'s buffers/parameters `names` (all of them if None) from DDP's broadcasts.

    Use it for queues, centres and momentum encoders: DDP would otherwise overwrite them
    with rank 0's copy before every forward (field notes, section 4).
    """
    if names is None:
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    existing = set(getattr(module, _STATE_ATTR, ()))
    existing.update(names)
    setattr(module, _STATE_ATTR, existing)


def rank_local_state_names(model: nn.Module) -> list[str]:
    """Fully qualified names of everything marked with `mark_rank_local_state`."""
    out: list[str] = []
    for prefix, mod in model.named_modules():
        for name in sorted(getattr(mod, _STATE_ATTR, ())):
            out.append(f"{prefix}.{name}" if prefix else name)
    return out
