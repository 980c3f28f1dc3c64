"""SimSiam (Chen & He, 2021): a predictor on one view regresses the other view's projection.

    z = g(f(x))                 backbone f, projector g (last layer followed by BN)
    p = h(z)                    predictor h: bottleneck MLP d -> d/4 -> d
    loss = SimSiamLoss(p_a, p_b, z_a, z_b) = -(cos(p_a, sg(z_b)) + cos(p_b, sg(z_a))) / 2

No momentum network and no negatives; the stop-gradient sg (inside the loss) prevents
collapse. Each view runs in its own forward pass (as the official code).

Defaults: the paper's CIFAR-10 setting (2-layer projector, each layer followed by batch
norm, the output BN without affine parameters as in the official code; predictor with a
4x bottleneck; SGD, base lr 0.03 per 256 images, weight decay 5e-4, momentum 0.9), with
the widths reduced for CPU from 2048/512 to 512/128 (pass ``proj_hidden_dim=2048,
proj_dim=2048, pred_hidden_dim=512`` for the paper's). SimCLR's colour augmentations with crops from 20 %
(the paper's, preset ``mocov2``).

Distributed semantics: per-sample loss, nothing to communicate; each rank returns the mean
over its local samples. Exact under DDP when batch norm is synchronised (SyncBN). The
gather setting does not apply.

Example::

    backbone, dim = build_backbone("resnet18")
    model = SimSiam(backbone, dim, SimSiamParams())
    loss = model([view_a, view_b])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.losses import SimSiamLoss
from unison.models import mlp

from ._common import two_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class SimSiamParams:
    proj_hidden_dim: int = 512      # paper: 2048 (reduced for CPU)
    proj_dim: int = 512             # paper: 2048 (reduced for CPU)
    pred_hidden_dim: int = 128      # bottleneck, proj_dim / 4 as in the paper
    proj_layers: int = 2            # 2 for CIFAR (paper), 3 for ImageNet

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "pred_hidden_dim", "proj_layers"))


class SimSiam(SSLMethod):
    name = "simsiam"
    Params = SimSiamParams
    recipe = Recipe(optimizer="sgd", base_lr=0.03, weight_decay=5e-4, augmentation="mocov2",
                    embedded={"base_lr": 0.1})  # the digits' short schedule: a higher rate

    def __init__(self, backbone: nn.Module, feature_dim: int, params: SimSiamParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             last_batch_norm=True, last_bn_affine=False)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2)
        self.loss_fn = SimSiamLoss()

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "SimSiam")
        z_a = self.projector(self.backbone(a))
        z_b = self.projector(self.backbone(b))
        return self.loss_fn(self.predictor(z_a), self.predictor(z_b), z_a, z_b)

    def exactness_note(self) -> str | None:
        return None   # per-sample loss: exact whatever the gather setting (given SyncBN)
