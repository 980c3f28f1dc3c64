"""The momentum teacher of BYOL, MoCo, DINO, iBOT, I-JEPA and MoCo v3, written once.

A `MomentumTeacher` holds frozen copies of some of a method's online modules, under the
names they have on the method, and moves them towards the online ones after every
optimiser step:

    teacher.<name> <- m * teacher.<name> + (1 - m) * method.<name>        (parameters only)

Buffers (batch-norm running statistics) evolve through the teacher's own forward passes, as
in the official MoCo / BYOL / DINO code. The schedule of ``m`` stays with the method
(`cosine_momentum` for BYOL / DINO / iBOT / MoCo v3, linear for I-JEPA, constant for MoCo v2).

Distributed semantics: the whole teacher is rank-local state (`mark_rank_local_state`), so
DDP never broadcasts it (it would otherwise overwrite it with rank 0's copy before every
forward) and it is saved in checkpoints. Every rank applies the same update to the same
online parameters (DDP has already averaged their gradients), so the teachers stay
identical. ``sync_once()`` copies rank 0's teacher to every rank on the first forward, which
makes a method safe even when the ranks built it from different random initialisations.

Example::

    self.target = MomentumTeacher(backbone=self.backbone, projector=self.projector)
    ...
    self.target.sync_once()                                  # first forward: rank 0's copy everywhere
    with torch.no_grad():
        z = self.target.projector(self.target.backbone(x))
    ...
    self.target.update(self, momentum)                       # in on_after_step
"""

from __future__ import annotations

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state

from ._common import broadcast_once, ema_update_, module_state, momentum_copy


class MomentumTeacher(nn.Module):
    """Frozen EMA copies of the given online modules, rank-local; see the module docstring."""

    def __init__(self, **online: nn.Module):
        super().__init__()
        if not online:
            raise ValueError("MomentumTeacher needs at least one online module")
        for name, module in online.items():
            self.add_module(name, momentum_copy(module))
        mark_rank_local_state(self)

    def __getattr__(self, name: str) -> nn.Module:
        # Typed for the copies (nn.Module.__getattr__ is typed Tensor | Module); lookup is nn.Module's.
        return super().__getattr__(name)  # type: ignore[return-value]

    def sync_once(self) -> None:
        """On the first call, overwrite this teacher with rank 0's (a no-op afterwards and in one process)."""
        broadcast_once(self, lambda: module_state(self))

    @torch.no_grad()
    def update(self, method: nn.Module, momentum: float) -> None:
        """teacher.<name> <- momentum * teacher.<name> + (1 - momentum) * method.<name>, for every copy."""
        for name, target in self.named_children():
            ema_update_(target, getattr(method, name), momentum)

    @torch.no_grad()
    def load_from(self, source: nn.Module) -> None:
        """teacher.<name> <- source.<name> exactly (parameters and buffers), for every copy: a snapshot of another
        teacher (DINOv3's Gram teacher of the EMA teacher). Under FSDP both are sharded alike: local shards."""
        for name, target in self.named_children():
            other = getattr(source, name)
            for a, b in zip([*target.parameters(), *target.buffers()], [*other.parameters(), *other.buffers()],
                            strict=True):
                a.copy_(b)
