"""TiCo (Zhu et al., 2022): transformation invariance and covariance contrast, with a momentum target.

    online:  z = g(f(x_a))                    backbone f, projector g (2 layers, the hidden one with batch norm)
    target:  z' = g'(f'(x_b))                 EMA of (f, g), no gradient
    C_t   =  beta C_{t-1} + (1 - beta) mean_i z_i z_i^T            (normalised z, global batch, no gradient)
    loss  =  TiCoLoss(z, z') = 1 - mean_i <z_i, z'_i> + rho mean_i z_i^T C_t z_i
    f', g' <- m f', g' + (1 - m) f, g,  m = 1 - (1 - 0.99) (cos(pi step / steps_total) + 1) / 2

The covariance term contrasts each embedding with every past batch at once (C_t decays by beta per step): the
paper reads it as MoCo with an implicit memory bank of unlimited size, at the memory of one d x d matrix.

Defaults: beta 0.9 and rho 8 (the paper's, Lightly's ``TiCoLoss``); the architecture of Lightly's TiCo example and
ImageNet benchmark, which the paper's code is not public to check against: a momentum target for the second view,
momentum 0.99 with a cosine schedule to 1, projector 2 layers 1024 wide and 256 out (``TiCoProjectionHead(512,
1024, 256)``; the paper: 4096 / 256); BYOL's augmentations (Lightly's ``TiCoTransform``). Optimiser: LARS, lr 0.2
per 256 images, weight decay 1.5e-6 (Lightly's ImageNet benchmark, the paper's LARS setting; no CIFAR-10 setting
is published).

Distributed semantics
---------------------
* The covariance C is the loss's state (`unison.losses.tico`): updated from the second moment of the GLOBAL batch
  (`all_reduce_no_grad` of [sum z z^T, count]), so it is identical on every rank and equal to one process's C.
  It carries no gradient, and given C both terms are means of per-sample terms: each rank's loss is its share of
  the global-batch loss and DDP's gradient average is its exact gradient.
* Exact with gather on and SyncBN (batch norm in the projector, and in the target's, whose statistics SyncBN
  makes global too). Under exact gradient accumulation C is updated once per step from all K micro-batches.
* What is not bitwise: C is a sum over the global batch, added in a different order at W ranks than in one
  process; the difference is float rounding (1e-16 relative in float64), within `unison check`'s tolerance.
* The target network (a `MomentumTeacher`), C and the step counter are rank-local state (never broadcast by DDP)
  and persistent (saved in checkpoints: a resumed run continues with the same C); rank 0's target is copied to
  every rank once, on the first forward.

Example::

    backbone, dim = build_backbone("resnet18")
    model = TiCo(backbone, dim, TiCoParams(), steps_total=10_000)
    loss = model([view_a, view_b]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.losses import TiCoLoss
from unison.models import mlp

from ._common import check_global_views, cosine_momentum, two_views
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class TiCoParams:
    beta: float = 0.9               # paper, Lightly: momentum of the covariance
    rho: float = 8.0                # paper, Lightly: weight of the covariance contrast
    proj_hidden_dim: int = 1024     # Lightly's TiCo example (paper: 4096)
    proj_dim: int = 256
    momentum_base: float = 0.99     # Lightly's ImageNet benchmark; cosine schedule to 1

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), non_negative=("rho",),
                     unit_interval=("beta", "momentum_base"))


class TiCo(SSLMethod):
    name = "tico"
    Params = TiCoParams
    recipe = Recipe(optimizer="lars", base_lr=0.2, weight_decay=1.5e-6, augmentation="byol")

    step_count: torch.Tensor   # buffer: optimiser steps taken

    def __init__(self, backbone: nn.Module, feature_dim: int, params: TiCoParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.target = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = TiCoLoss(params.proj_dim, params.beta, params.rho, gather_distributed=self.gather_distributed)

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("TiCo", view_sizes, exactly=2)

    def momentum(self, step: float) -> float:
        """The target's EMA momentum after optimiser step `step` (0-based)."""
        return cosine_momentum(self.params.momentum_base, self.schedule_step(step), self.steps_total)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "TiCo")
        self.target.sync_once()
        z = self.projector(self.backbone(a))
        with torch.no_grad():
            z_target = self.target.projector(self.target.backbone(b))
        return self.loss_fn(z, z_target)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.target.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)
