"""DCL and DCLW (Yeh et al., 2022): SimCLR with the decoupled contrastive loss, the positive out of the denominator.

    h = backbone(x),  z = g(h)  (2-layer MLP),  loss = DCLLoss(z_a, z_b; T)        (``--method dcl``)
                                                loss = DCLWLoss(z_a, z_b; T, sigma)  (``--method dclw``)

The decoupled loss drops the positive pair from InfoNCE's denominator, which removes the negative-positive
coupling that makes SimCLR need large batches; DCLW also weights each positive pair by the negative von
Mises-Fisher weight w_i = 2 - exp(<z_a[i], z_b[i]>/sigma) / mean_j exp(<z_a[j], z_b[j]>/sigma) (sigma = 0.5), which
gives the hard positives (views far apart) more weight (formulas: `unison.losses.dcl`).

Defaults: the paper's temperature 0.1 and sigma 0.5 (Lightly's ``DCLLoss`` / ``DCLWLoss`` defaults); the rest is
Lightly's CIFAR-10 benchmark for DCL and DCLW, which is its SimCLR's: projector 512-512-128, SGD, lr 0.06 per 128
images (0.12 per 256), weight decay 5e-4, SimCLR's augmentations with colour-jitter strength 0.5. Both views run
through the backbone in one pass (as unison's SimCLR and Lightly's ImageNet DCL benchmark): batch norm sees both.

Distributed semantics: the negatives are the embeddings of every rank (autograd-correct gather in `DCLLoss`);
each rank scores its local anchors against the global batch. DCLW's weights are normalised over the gathered
global batch too (Lightly normalises them per rank). Exact under DDP with gather on and SyncBN (the projection
head has batch norm).

Example::

    backbone, dim = build_backbone("resnet18")
    model = DCLW(backbone, dim, DCLWParams())
    loss = model([view_a, view_b])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison.losses import DCLLoss, DCLWLoss
from unison.models import mlp

from ._common import check_global_views, two_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class DCLParams:
    temperature: float = 0.1       # paper, Lightly's DCLLoss
    proj_hidden_dim: int = 512     # Lightly CIFAR-10 benchmark (SimCLRProjectionHead(512, 512, 128))
    proj_dim: int = 128

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), temperatures=("temperature",))


@dataclass
class DCLWParams(DCLParams):
    sigma: float = 0.5             # paper, Lightly's DCLWLoss: the von Mises-Fisher weighting's scale

    def __post_init__(self) -> None:
        super().__post_init__()
        check_params(self, temperatures=("sigma",))   # exp(cos / sigma): the same overflow bound as 1 / T


class DCL(SSLMethod):
    name = "dcl"
    Params = DCLParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="simclr")

    def __init__(self, backbone, feature_dim: int, params: DCLParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.loss_fn = self._loss(params)

    def _loss(self, params: Any) -> DCLLoss:
        return DCLLoss(params.temperature, gather_distributed=self.gather_distributed)

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views(cls.name.upper(), view_sizes, exactly=2)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, self.name.upper())
        z = self.projector(self.backbone(torch.cat([a, b])))   # one pass: BN sees both views
        z_a, z_b = z.chunk(2)
        return self.loss_fn(z_a, z_b)


class DCLW(DCL):
    name = "dclw"
    Params = DCLWParams

    def _loss(self, params: Any) -> DCLLoss:
        return DCLWLoss(params.temperature, params.sigma, gather_distributed=self.gather_distributed)
