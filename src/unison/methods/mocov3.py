"""MoCo v3 (Chen, Xie & He, 2021): a query encoder with a predictor against a momentum key encoder, in-batch keys.

    q = p(g(f(x)))                     backbone f, projector g (3 layers), predictor p (2 layers), trained
    k = g'(f'(x))                      momentum encoder: EMA of (f, g), no gradient
    loss = MoCoV3Loss(q_a, k_b) + MoCoV3Loss(q_b, k_a)      InfoNCE against the keys of the global batch, x 2T
    f', g' <- m f', g' + (1 - m) f, g,  m = 1 - (1 - 0.99) (cos(pi step / steps_total) + 1) / 2

No queue: the negatives are the other keys of the same (global) batch. With a ViT backbone
the patch projection is frozen at its random initialisation (``freeze_patch_embed``; the
paper's fix for training instability). Each view runs through the networks in its own pass
(as the official code), so batch norm normalises each view's batch separately.

Defaults: T = 0.2, momentum 0.99 with the cosine schedule to 1 (paper, ViT); projector
3 layers and predictor 2 layers with batch norm, the last one without affine parameters
(official ``_build_mlp``), 1024 wide and 256 out (paper: 4096 / 256); AdamW, lr 1.5e-4 per
256 images, weight decay 0.1 (paper, ViT); BYOL augmentations.

Distributed semantics: keys carry no gradient, so they are gathered without autograd
(`gather_no_grad`, in `unison.losses.mocov3`) and each rank scores its local queries against
all N keys; each rank's loss is the mean over its local queries, so DDP's average is the
exact global-batch gradient. Batch norm in the heads (and in the key encoder) needs SyncBN,
which also makes the key encoder's statistics global. The momentum encoder and the step
counter are rank-local state (a `MomentumTeacher`, saved in checkpoints, copied from rank 0
on the first forward).

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = MoCoV3(backbone, dim, MoCoV3Params(), steps_total=10_000)
    loss = model([view_a, view_b]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.losses import MoCoV3Loss
from unison.models import mlp
from unison.models.vit import ViT

from ._common import cosine_momentum, two_views
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class MoCoV3Params:
    temperature: float = 0.2            # paper, ViT (ResNet: 1.0)
    momentum_base: float = 0.99         # paper, ViT; cosine schedule to 1
    proj_hidden_dim: int = 1024         # paper: 4096 (reduced for CPU)
    proj_dim: int = 256
    pred_hidden_dim: int = 1024         # paper: 4096
    freeze_patch_embed: bool = True     # paper: random (frozen) patch projection for ViTs

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "pred_hidden_dim"), temperatures=("temperature",),
                     unit_interval=("momentum_base",))


class MoCoV3(SSLMethod):
    step_count: torch.Tensor
    name = "mocov3"
    Params = MoCoV3Params
    recipe = Recipe(optimizer="adamw", base_lr=1.5e-4, weight_decay=0.1, augmentation="byol",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 1e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: MoCoV3Params, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        if params.freeze_patch_embed and isinstance(backbone, ViT):
            backbone.patch_embed.requires_grad_(False)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 3, last_batch_norm=True,
                             last_bn_affine=False)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2, last_batch_norm=True,
                             last_bn_affine=False)
        self.momentum_encoder = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = MoCoV3Loss(params.temperature, gather_distributed=self.gather_distributed)

    def momentum(self, step: float) -> float:
        return cosine_momentum(self.params.momentum_base, self.schedule_step(step), self.steps_total)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "MoCo v3")
        self.momentum_encoder.sync_once()
        q_a = self.predictor(self.projector(self.backbone(a)))
        q_b = self.predictor(self.projector(self.backbone(b)))
        with torch.no_grad():
            k_a = self.momentum_encoder.projector(self.momentum_encoder.backbone(a))
            k_b = self.momentum_encoder.projector(self.momentum_encoder.backbone(b))
        return self.loss_fn(q_a, k_b) + self.loss_fn(q_b, k_a)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.momentum_encoder.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)
