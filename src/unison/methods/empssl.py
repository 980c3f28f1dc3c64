"""EMP-SSL (Tong et al., 2023): many fixed-size patches per image, a coding-rate regulariser, invariance to their mean.

    z_p  = normalize(g(f(x_p)))            P patches of each image, ONE backbone pass over all of them;
                                           projector g: 3 layers (two with BN and ReLU)
    loss = EMPSSLLoss(z) = -(1/P) sum_p TCR(Z_p)  -  200 (1/P) sum_p mean_i cos(z_pi, mean_p z_pi)

The patches (preset ``patches``) are square crops of a quarter of the image's area resized to the image size, with
SimCLR-style colour ops (`unison.data.presets`); their number is the parameter ``n_patches``.

Recipe: the official CIFAR-10 command (``README.md``: ``--num_patches 20 --patch_sim 200 --lr 0.3``, ``main.py``):
20 patches, TCR eps 0.2, invariance weight 200, projector 512-4096-4096-1024 (1024-1024-512 here, for CPU), LARS
with weight decay 1e-4 and lr 0.3 for its batch of 100; here unison's LARS (trust coefficient 1e-3, biases and
norms excluded) at lr 0.3 per 256 images. The paper's claim is the number of epochs: a few epochs reach what other
methods reach in hundreds, but each epoch costs ``n_patches`` backbone passes per image. Not here: its
bag-of-features evaluation (the mean embedding of many patches per test image); unison evaluates the backbone
on the whole image, as for every method.

Distributed semantics (see `unison.losses.empssl`): the coding rate of each patch is taken over the GLOBAL batch:
the [P, d, d] Gram matrices are summed over ranks with ``all_reduce_with_grad`` and N is the global batch (the
paper's is over its batch, on one GPU); the invariance term is a mean over local images. DDP's gradient average is
the exact gradient of the global-batch loss. Exact with gather on and SyncBN.

Example::

    backbone, dim = build_backbone("resnet18")
    model = EMPSSL(backbone, dim, EMPSSLParams(n_patches=20))
    loss = model(patches)           # 20 patches [n, 3, H, W] of the same n images
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.losses import EMPSSLLoss
from unison.models import mlp

from ._common import check_global_views, same_size_views
from .base import Recipe, SSLMethod
from .params import check_params, check_trains


@dataclass
class EMPSSLParams:
    n_patches: int = 20             # official CIFAR-10 command (its default: 100)
    proj_hidden_dim: int = 1024     # official: 4096 (reduced for CPU)
    proj_dim: int = 512             # official: 1024 (reduced for CPU)
    tcr_eps: float = 0.2
    inv_weight: float = 200.0       # official patch_sim
    tcr_weight: float = 1.0         # official tcr

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), classes=("n_patches",), positive=("tcr_eps",),
                     non_negative=("inv_weight", "tcr_weight"))
        check_trains(self, {"inv_weight": self.inv_weight > 0, "tcr_weight": self.tcr_weight > 0})


class EMPSSL(SSLMethod):
    name = "empssl"
    Params = EMPSSLParams
    recipe = Recipe(optimizer="lars", base_lr=0.3, weight_decay=1e-4, augmentation="patches", views_param="n_patches")

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("EMP-SSL", view_sizes, exactly=params.n_patches, presets="patches (as many as n_patches)")

    def __init__(self, backbone: nn.Module, feature_dim: int, params: EMPSSLParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 3)
        self.loss_fn = EMPSSLLoss(params.tcr_eps, params.inv_weight, params.tcr_weight,
                                  gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        n = same_size_views(views, "EMP-SSL", self.params.n_patches, "n_patches")
        z = F.normalize(self.projector(self.backbone(torch.cat(views))), dim=1)   # one pass over every patch
        return self.loss_fn(z.reshape(len(views), n, -1))
