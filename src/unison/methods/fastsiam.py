"""FastSiam (Pototzky et al., 2022): SimSiam with 4 views, each view's prediction regresses the mean of the others.

    z_v = g(f(x_v))               backbone f, projector g (last layer followed by BN), for each of the K views
    p_v = h(z_v)                  predictor h: bottleneck MLP d -> d/4 -> d
    loss = FastSiamLoss(p, z) = (1/K) sum_v -cos(p_v, sg(mean_{u != v} z_u))          (K = 4)

A target averaged over three views is steadier than SimSiam's one other view, so fewer epochs (and one GPU)
suffice. No momentum network and no negatives; the stop-gradient sg (inside the loss) prevents collapse. Each
view runs in its own forward pass (as SimSiam's official code and Lightly's FastSiam).

Views: the ``fastsiam`` augmentation preset, SimSiam's views (SimCLR's colour operations, crops from 20 % of the
image) x 4, as Lightly's ``FastSiamTransform``; ``digits_fastsiam`` on the embedded digits. Any number >= 2 of
same-size views trains (``--augmentation``); 2 is SimSiam.

Defaults: SimSiam's heads and recipe as unison's `unison.methods.simsiam` (the paper builds on SimSiam's CIFAR-10
setting, as Lightly's CIFAR-10 FastSiam benchmark: 2-layer projector with batch norm after each layer, a 4x
bottleneck predictor, SGD, lr 0.03 per 256 images, weight decay 5e-4), widths reduced for CPU from 2048 / 512 to
512 / 128 (pass ``proj_hidden_dim=2048, proj_dim=2048, pred_hidden_dim=512`` for the paper's). On the embedded
digits' short schedule the learning rate is 0.1, as SimSiam's there.

Distributed semantics: per-sample loss, nothing to communicate; each rank returns the mean over its local
samples. Exact under DDP when batch norm is synchronised (SyncBN). The gather setting does not apply.

Example::

    backbone, dim = build_backbone("resnet18")
    model = FastSiam(backbone, dim, FastSiamParams())
    loss = model([view_1, view_2, view_3, view_4])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from unison.losses import FastSiamLoss
from unison.models import mlp

from ._common import check_global_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class FastSiamParams:
    proj_hidden_dim: int = 512      # paper (SimSiam's): 2048 (reduced for CPU)
    proj_dim: int = 512             # paper: 2048 (reduced for CPU)
    pred_hidden_dim: int = 128      # bottleneck, proj_dim / 4 as SimSiam's
    proj_layers: int = 2            # 2 for CIFAR (SimSiam's paper), 3 for ImageNet

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "pred_hidden_dim", "proj_layers"))


class FastSiam(SSLMethod):
    name = "fastsiam"
    Params = FastSiamParams
    # The embedded digits' 150 steps: SimSiam's short-schedule rate, as unison's SimSiam (docs/benchmarks.md).
    recipe = Recipe(optimizer="sgd", base_lr=0.03, weight_decay=5e-4, augmentation="fastsiam",
                    embedded={"base_lr": 0.1})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: FastSiamParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             last_batch_norm=True, last_bn_affine=False)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2)
        self.loss_fn = FastSiamLoss()

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("FastSiam", view_sizes, at_least=2, presets="fastsiam (4 views) or another preset "
                           "without local crops")

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        if len(views) < 2 or any(v.shape != views[0].shape for v in views):
            raise ValueError(f"FastSiam takes 2 or more views of one shape (4 in the paper), got "
                             f"{[tuple(v.shape) for v in views]}")
        z = [self.projector(self.backbone(v)) for v in views]
        return self.loss_fn([self.predictor(z_v) for z_v in z], z)

    def exactness_note(self) -> str | None:
        return None   # per-sample loss: exact whatever the gather setting (given SyncBN)
