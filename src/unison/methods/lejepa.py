"""LeJEPA (Balestriero & LeCun, 2025): views predict the mean global-view embedding, SIGReg keeps them Gaussian.

    z_v = g(f(x_v))             backbone f (class token of a ViT, one pass per crop size), projector g
                                (MLP with batch norm), for 2 global crops and the local crops
    loss = LeJEPALoss(z, n_global=2, directions)
         = (1 - lambda) * mean_v ||mean_global(z) - z_v||^2 / K  +  lambda * mean_v SIGReg(z_v)

No teacher, no stop-gradient, no predictor network, one trade-off lambda. The SIGReg
directions are drawn afresh every step from (seed, step) (`sigreg_directions`), identical on
every rank, like the paper's generator seeded with the global step.

Defaults: lambda = 0.05, 256 directions, 17 quadrature points on [-5, 5] (paper, Algorithm 1);
projector 3 layers with batch norm, 512 wide, 64 out (paper: 2048 wide; its minimal example
projects to 16-128); AdamW, lr 5e-4 per 256 images, weight decay 0.05 (paper, ViT);
multi-crop augmentations. Works with any backbone; its recipe uses a ViT.

Distributed semantics: SIGReg's empirical characteristic function is the mean over the
GLOBAL batch, from one differentiable all-reduce (`all_reduce_with_grad`) of the per-rank
sums, so its gradient is exact (Lightly's was 1/W of the true one, lightly#1920; see
`unison.losses.lejepa`). The prediction term is a mean over local samples. Batch norm in the
projector needs SyncBN. Exact with gather on; the step counter is rank-local state.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = LeJEPA(backbone, dim, LeJEPAParams(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import LeJEPALoss, sigreg_directions
from unison.models import mlp

from ._common import TWO_VIEWS_MEASURED_UP_TO_PX, check_multicrop, multicrop_features
from .base import Recipe, SampleKeys, SSLMethod
from .params import check_params


@dataclass
class LeJEPAParams:
    lambd: float = 0.05                 # paper: SIGReg weight
    num_slices: int = 256               # paper, Algorithm 1
    knots: int = 17                     # quadrature points on [-t_max, t_max] (paper)
    t_max: float = 5.0
    proj_hidden_dim: int = 512          # paper: 2048 (reduced for CPU)
    proj_dim: int = 64
    proj_layers: int = 3

    def __post_init__(self) -> None:
        check_params(self, sizes=("num_slices", "proj_hidden_dim", "proj_dim", "proj_layers"),
                     positive=("t_max",), unit_interval=("lambd",))
        if not isinstance(self.knots, int) or self.knots < 2:
            raise ConfigError(f"LeJEPA parameter knots={self.knots!r} must be an integer >= 2 (--param knots=VALUE)")


class LeJEPA(SSLMethod):
    step_count: torch.Tensor
    name = "lejepa"
    Params = LeJEPAParams
    needs_sample_keys = True           # the run's seed: SIGReg's directions are a function of (seed, step)
    recipe = Recipe(optimizer="adamw", base_lr=5e-4, weight_decay=0.05, augmentation="multicrop",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 2e-3},
                    global_views_up_to=TWO_VIEWS_MEASURED_UP_TO_PX)

    def __init__(self, backbone: nn.Module, feature_dim: int, params: LeJEPAParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = LeJEPALoss(params.lambd, params.knots, params.t_max, gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("LeJEPA draws its directions from the run's seed: call it with keys=SampleKeys(...)")
        n = check_multicrop(views, "LeJEPA")
        z = self.projector(multicrop_features(self.backbone, views))
        z = z.view(len(views), n, -1)
        directions = sigreg_directions(keys.seed, int(self.step_count), z.shape[-1], self.params.num_slices,
                                       device=z.device, dtype=z.dtype)
        return self.loss_fn(z, n_global=2, directions=directions)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: SIGReg tests each rank's local batch"
        return None
