"""SimCLR (Chen et al., 2020): two augmented views, a projection MLP, NT-Xent over the global batch.

    h = backbone(x),  z = g(h)  (2-layer MLP),  loss = NTXent(z_a, z_b; T)

Distributed: negatives are the embeddings of every rank (autograd-correct gather in
`NTXentLoss`); each rank scores its local anchors only. Exact under DDP with gather on
and SyncBN (the projection head has batch norm).

Example::

    backbone, dim = build_backbone("resnet18")
    model = SimCLR(backbone, dim, SimCLRParams())
    loss = model([view_a, view_b])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unison.losses import NTXentLoss
from unison.models import mlp

from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class SimCLRParams:
    temperature: float = 0.5       # CIFAR-10 setting of the SimCLR paper and Lightly's benchmark
    proj_hidden_dim: int = 512
    proj_dim: int = 128

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), temperatures=("temperature",))


class SimCLR(SSLMethod):
    name = "simclr"
    Params = SimCLRParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="simclr")

    def __init__(self, backbone, feature_dim: int, params: SimCLRParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.loss_fn = NTXentLoss(params.temperature, gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = views[0], views[1]
        z = self.projector(self.backbone(torch.cat([a, b])))   # one pass: BN sees both views
        z_a, z_b = z.chunk(2)
        return self.loss_fn(z_a, z_b)
