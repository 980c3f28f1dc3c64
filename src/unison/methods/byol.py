"""BYOL (Grill et al., 2020): an online network predicts a momentum target network's projection.

    online:  z = g(f(x)),  p = q(z)          backbone f, projector g, predictor q (trained)
    target:  z' = g'(f'(x))                  EMA of (f, g), no gradient
    loss  =  BYOLLoss(p_a, p_b, z'_a, z'_b)  = mean of 2 - 2 cos(p_a, z'_b) and 2 - 2 cos(p_b, z'_a)
    f', g' <- tau f', g' + (1 - tau) f, g    after every step,
    tau    =  1 - (1 - tau_base) * (cos(pi * step / steps_total) + 1) / 2      (tau_base = 0.99)

Each view runs through the networks in its own forward pass (as official BYOL), so batch
norm normalises each view's batch separately.

Defaults: CIFAR-10 settings of Lightly's benchmark (projector 512-1024-256, predictor
256-1024-256 with batch norm, SGD momentum 0.9, weight decay 5e-4) with the paper's cosine
momentum schedule from tau_base = 0.99 (solo-learn's CIFAR value). Lightly minimises
mean(-cos) averaged over the two directions at lr 0.12 per 256 images; `BYOLLoss`
(2 - 2 cos) has twice its gradient, so the recipe uses lr 0.06 and weight decay 1e-3 to
take the same SGD steps. BYOL augmentations.

Distributed semantics: no cross-sample term in the loss (each rank returns the mean over
its local samples); exact under DDP when batch norm is synchronised (SyncBN), which also
makes the target's batch statistics global. The target network (a `MomentumTeacher`) and the step
counter are rank-local state (never broadcast by DDP); rank 0's target is copied to every
rank once, on the first forward. The gather setting does not apply.

Example::

    backbone, dim = build_backbone("resnet18")
    model = BYOL(backbone, dim, BYOLParams(), steps_total=10_000)
    loss = model([view_a, view_b]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.losses import BYOLLoss
from unison.models import mlp

from ._common import cosine_momentum, two_views
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class BYOLParams:
    proj_hidden_dim: int = 1024     # Lightly CIFAR-10 benchmark (paper: 4096)
    proj_dim: int = 256
    pred_hidden_dim: int = 1024
    momentum_base: float = 0.99     # tau_base for CIFAR (paper, ImageNet: 0.996)

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "pred_hidden_dim"), unit_interval=("momentum_base",))


class BYOL(SSLMethod):
    name = "byol"
    Params = BYOLParams
    # Embedded default (150 steps): Adam moves the online network far enough for the target to follow;
    # the SGD recipe stays at random-init accuracy there (docs/archive/benchmarks-history.md has both runs).
    recipe = Recipe(optimizer="sgd", base_lr=0.06, weight_decay=1e-3, augmentation="byol",
                    embedded={"optimizer": "adam", "base_lr": 2e-3, "weight_decay": 1e-6})

    step_count: torch.Tensor   # buffer: optimiser steps taken

    def __init__(self, backbone: nn.Module, feature_dim: int, params: BYOLParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2)
        self.target = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = BYOLLoss()

    def momentum(self, step: float) -> float:
        """tau at optimiser step `step` (0-based)."""
        return cosine_momentum(self.params.momentum_base, self.schedule_step(step), self.steps_total)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "BYOL")
        self.target.sync_once()
        p_a = self.predictor(self.projector(self.backbone(a)))
        p_b = self.predictor(self.projector(self.backbone(b)))
        with torch.no_grad():
            z_a = self.target.projector(self.target.backbone(a))
            z_b = self.target.projector(self.target.backbone(b))
        return self.loss_fn(p_a, p_b, z_a, z_b)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.target.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        return None   # per-sample loss: exact whatever the gather setting (given SyncBN)
