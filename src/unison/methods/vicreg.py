"""VICReg (Bardes et al., 2022): invariance + variance + covariance regularisation.

    z = g(f(x))                    backbone f, projector g (3 layers, last without bias)
    loss = VICRegLoss(z_a, z_b)    25 * MSE(z_a, z_b) + 25 * variance hinge + 1 * off-diagonal covariance

Defaults: weights 25 / 25 / 1, gamma 1, eps 1e-4 (paper, solo-learn); projector 3 layers
with widths reduced for CPU to 512-512-512 (solo-learn CIFAR: 2048-2048). Recipe:
solo-learn's CIFAR-10 setting, LARS, lr 0.3 per 256 images, weight decay 1e-4; BYOL-style
augmentations (solo-learn's VICReg CIFAR augmentations include solarisation).

Distributed semantics (see `unison.losses.vicreg`): the invariance term is the mean over
local samples; the variance and covariance terms use the batch of all ranks gathered with
``all_gather_with_grad`` and appear once in every rank's loss. DDP's gradient average is
then exactly the gradient of the global-batch loss. Exact with gather on and SyncBN.

Example::

    backbone, dim = build_backbone("resnet18")
    model = VICReg(backbone, dim, VICRegParams())
    loss = model([view_a, view_b])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.losses import VICRegLoss
from unison.models import mlp

from ._common import two_views
from .base import Recipe, SSLMethod
from .params import check_params, check_trains


@dataclass
class VICRegParams:
    proj_hidden_dim: int = 512      # solo-learn CIFAR: 2048, paper: 8192 (reduced for CPU)
    proj_dim: int = 512
    proj_layers: int = 3
    sim_weight: float = 25.0        # lambda
    var_weight: float = 25.0        # mu
    cov_weight: float = 1.0         # nu
    gamma: float = 1.0
    eps: float = 1e-4

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "proj_layers"), non_negative=("sim_weight", "var_weight", "cov_weight"),
                     positive=("gamma", "eps"))
        check_trains(self, {name: getattr(self, name) > 0 for name in ("sim_weight", "var_weight", "cov_weight")})


class VICReg(SSLMethod):
    name = "vicreg"
    Params = VICRegParams
    recipe = Recipe(optimizer="lars", base_lr=0.3, weight_decay=1e-4, augmentation="byol")

    def __init__(self, backbone: nn.Module, feature_dim: int, params: VICRegParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             bias_last=False)
        self.loss_fn = VICRegLoss(params.sim_weight, params.var_weight, params.cov_weight, params.gamma,
                                  params.eps, gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "VICReg")
        return self.loss_fn(self.projector(self.backbone(a)), self.projector(self.backbone(b)))
