"""Self-distillation with a momentum teacher, as DINO and iBOT share it, written once.

    student head h: `DINOHead` (MLP -> L2-normalised bottleneck -> weight-normalised prototypes)
    teacher f', h': a `MomentumTeacher` of (backbone, head), rank-local, no gradient
    f', h' <- m f', h' + (1 - m) f, h,  m = 1 - (1 - momentum_base) (cos(pi step / steps_total) + 1) / 2
    tau_t(step): linear warm-up warmup_teacher_temp -> teacher_temp over the first
                 ``teacher_temp_warmup_fraction`` of the steps, then constant

`SelfDistillation` is the base class of `unison.methods.dino.DINO` and `unison.methods.ibot.IBOT`:
they call `build_distillation` in their ``__init__`` (at the point where the head's parameters
are to be registered: the order of parameters, and of the random draws of their initialisation,
is part of a run's result), read ``teacher_temp(int(self.step_count))`` in their forward and
inherit ``on_after_step`` (teacher update, then the step counter). Their ``Params`` dataclasses
carry the fields named by `DistillationParams`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.tagging import mark_rank_local_state

from ._common import cosine_momentum
from .base import SSLMethod
from .teacher import MomentumTeacher


class DINOHead(nn.Module):
    """MLP -> L2-normalised bottleneck -> weight-normalised linear layer (unit-norm rows, no bias)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 num_layers: int = 3, batch_norm: bool = False):
        super().__init__()
        # the architecture, as `DINOHead(in_dim, **spec)` rebuilds it (distill's student head copies its teacher's)
        self.spec: dict[str, Any] = {"out_dim": out_dim, "hidden_dim": hidden_dim, "bottleneck_dim": bottleneck_dim,
                     "num_layers": num_layers, "batch_norm": batch_norm}
        if num_layers < 1:
            raise ValueError(f"the DINO head needs at least 1 layer, got {num_layers}")
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))   # a bias before BN is a no-op
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            dim = hidden_dim
        layers.append(nn.Linear(dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.last_layer.weight, dim=1))


class DistillationParams(Protocol):
    """The hyper-parameters `SelfDistillation` reads (fields of `DINOParams` and `IBOTParams`)."""

    hidden_dim: int
    bottleneck_dim: int
    out_dim: int
    head_layers: int
    head_batch_norm: bool
    momentum_base: float
    teacher_temp: float
    warmup_teacher_temp: float
    teacher_temp_warmup_fraction: float


class SelfDistillation(SSLMethod):
    """A method with a DINO head, its momentum teacher and a step counter; see the module docstring."""

    head: DINOHead
    ibot_head: DINOHead        # with a separate patch head (DINOv2's ``ibot.separate_head``) only
    teacher: MomentumTeacher
    step_count: torch.Tensor   # buffer: optimiser steps taken (rank-local, checkpointed)

    def build_distillation(self, params: DistillationParams, patch_head: bool = False) -> None:
        """Register the head, with `patch_head` a second head of the same shape for patch tokens (``ibot_head``),
        the teacher of (backbone, head[, ibot_head]) and the step counter, in this order."""
        self.head = DINOHead(self.feature_dim, params.out_dim, params.hidden_dim, params.bottleneck_dim,
                             params.head_layers, params.head_batch_norm)
        heads = {"head": self.head}
        if patch_head:
            self.ibot_head = DINOHead(self.feature_dim, params.out_dim, params.hidden_dim, params.bottleneck_dim,
                                      params.head_layers, params.head_batch_norm)
            heads["ibot_head"] = self.ibot_head
        self.teacher = MomentumTeacher(backbone=self.backbone, **heads)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])

    def momentum(self, step: float) -> float:
        """The teacher's EMA momentum after optimiser step `step`: cosine from ``momentum_base`` to 1."""
        return cosine_momentum(self.params.momentum_base, self.schedule_step(step), self.steps_total)

    def teacher_temp(self, step: float) -> float:
        """The teacher temperature at `step`: linear warm-up, then ``teacher_temp``."""
        p, step = self.params, self.schedule_step(step)
        warmup = round(p.teacher_temp_warmup_fraction * self.steps_total)
        if warmup <= 0 or step >= warmup:
            return p.teacher_temp
        return p.warmup_teacher_temp + (p.teacher_temp - p.warmup_teacher_temp) * step / warmup

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.teacher.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)
