"""Barlow Twins (Zbontar et al., 2021): make the cross-correlation of two views' embeddings the identity.

    z = g(f(x))                          backbone f, projector g (3 layers, last without bias)
    loss = BarlowTwinsLoss(z_a, z_b)     sum_i (1 - C_ii)^2 + lambda sum_{i!=j} C_ij^2,
                                         C = cross-correlation of the globally standardised z

Defaults: lambda = 5e-3 (paper, Lightly, solo-learn); projector 3 layers as in the paper
with widths reduced for CPU to 512-512-512 (paper 8192; Lightly's CIFAR-10 benchmark
2048); SGD momentum 0.9, lr 0.06 per 128 images (0.12 per 256), weight decay 5e-4 as in
Lightly's CIFAR-10 benchmark; BYOL augmentations (the paper's).

Distributed semantics (see `unison.losses.barlowtwins` for the proof): the embeddings are
standardised with the global batch's mean and variance and C is summed over ranks with
``all_reduce_with_grad``; every rank returns the global loss L, and DDP's gradient average
is exactly dL/dtheta. Exact with gather on and SyncBN. With gather off each rank uses its
local batch only.

Example::

    backbone, dim = build_backbone("resnet18")
    model = BarlowTwins(backbone, dim, BarlowTwinsParams())
    loss = model([view_a, view_b])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.losses import BarlowTwinsLoss
from unison.models import mlp

from ._common import two_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class BarlowTwinsParams:
    proj_hidden_dim: int = 512      # paper: 8192 (reduced for CPU)
    proj_dim: int = 512             # paper: 8192 (reduced for CPU)
    proj_layers: int = 3
    lambda_offdiag: float = 5e-3    # paper; ~1/d is an alternative for small d

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "proj_layers"), non_negative=("lambda_offdiag",))


class BarlowTwins(SSLMethod):
    name = "barlowtwins"
    Params = BarlowTwinsParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="byol",
                    embedded={"optimizer": "lars", "base_lr": 0.3})  # the digits' short schedule: SGD barely moves

    def __init__(self, backbone: nn.Module, feature_dim: int, params: BarlowTwinsParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             bias_last=False)
        self.loss_fn = BarlowTwinsLoss(params.lambda_offdiag, gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "Barlow Twins")
        return self.loss_fn(self.projector(self.backbone(a)), self.projector(self.backbone(b)))
