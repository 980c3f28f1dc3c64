"""MMCR (Yerxa et al., 2023): maximum manifold capacity, the nuclear norm of the images' view centroids.

    z_iv = normalize(g(f(x_iv)))           backbone f, projector g (2 layers, no biases), k views of image i
    c_i  = (1/k) sum_v z_iv,   C = [c_1; ...; c_N]
    loss = MMCRLoss(z) = -||C||_*  (+ lambda (1/N) sum_i ||Z_i||_*, lambda = 0)

All k views of a batch go through the backbone and the projector in ONE pass (batch norm over every view, as the
official code's ``(B N) C H W`` batch).

Recipe: the paper's CIFAR-10 setting (official ``pretrain_cifar_stl.py``, ``mmcr/cifar_stl``): projector
2048-512-128 without biases, BN and ReLU after the first layer (here from the backbone's width), Adam lr 1e-3,
weight decay 1e-6, lambda 0, SimCLR's augmentations without blur (``simclr``: blur is off at 32 px and below). The
paper trains 40 views of 32 images per step; the default here is 8 views (a step of 256 images then has 2,048
views, as the paper's 1,280), ``--param n_views=40`` for the paper's. Adam's lr is taken as is for 256 images (not
scaled up 8x from the paper's 32: the views, not the images, set the step's work). Not implemented: the momentum
encoder of the paper's ImageNet variant.

Distributed semantics (see `unison.losses.mmcr`): the centroids of every rank are gathered with
``all_gather_with_grad`` and every rank takes the nuclear norm of the global [N, d] centroid matrix (the global term
appears once in every rank's loss); DDP's gradient average is then exactly the gradient of the global-batch loss.
Exact with gather on and SyncBN.

Example::

    backbone, dim = build_backbone("resnet18")
    model = MMCR(backbone, dim, MMCRParams(n_views=8))
    loss = model(views)            # 8 views [n, 3, H, W] of the same n images
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from unison.losses import MMCRLoss
from unison.models import mlp

from ._common import check_global_views, same_size_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class MMCRParams:
    n_views: int = 8                # views per image (paper, CIFAR: 40; reduced for CPU)
    proj_hidden_dim: int = 512      # paper, CIFAR
    proj_dim: int = 128
    lambda_local: float = 0.0       # weight of the per-image nuclear norm (paper, CIFAR: 0)

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), classes=("n_views",),
                     non_negative=("lambda_local",))


class MMCR(SSLMethod):
    name = "mmcr"
    Params = MMCRParams
    recipe = Recipe(optimizer="adam", base_lr=1e-3, weight_decay=1e-6, augmentation="simclr", views_param="n_views")

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("MMCR", view_sizes, exactly=params.n_views, presets="simclr, byol or mocov2 (as many views as n_views)")

    def __init__(self, backbone: nn.Module, feature_dim: int, params: MMCRParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2, bias_last=False)
        self.loss_fn = MMCRLoss(params.lambda_local, gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        n = same_size_views(views, "MMCR", self.params.n_views, "n_views")
        z = self.projector(self.backbone(torch.cat(views)))          # one pass: BN sees every view
        return self.loss_fn(z.reshape(len(views), n, -1))
