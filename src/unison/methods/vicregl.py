"""VICRegL (Bardes et al., 2022): VICReg on the global embeddings and on matched cells of the feature maps.

    f(x_v) -> pooled feature y_v, feature map Y_v [h, w, C]      backbone with its pooling removed (`make_dense`)
    z_v = g(y_v)                  global projector (3 layers, last without bias; VICReg's)
    m_v = g_l(Y_v) cell by cell   maps projector (3 layers, batch norm over every cell of the batch)
    p_v = crop_v(centres)         where each cell's centre lies in the image: the view's crop box, flip and rotation
                                  (``keys.crops``, from the augmentation's own draws) applied to the cell centres
    loss = VICRegLLoss(z, m, p)   alpha * VICReg(z) + (1 - alpha) * VICReg of cells matched by feature distance
                                  and by location (`unison.losses.vicregl`: the formula)

Maps larger than ``grid_size`` cells a side (7: the paper's 7 x 7 of ResNet-50 and ConvNeXt at 224 px) are
average-pooled to it first (`unison.models.dense.coarse_grid`): the matching compares every cell with every cell.
Any backbone with a feature map: the small CNN and ResNets (their last stage), unison's ViTs (the patch tokens on
their grid), timm models. Views: 2 global views and any number of local crops (``--augmentation multicrop``).

Defaults: the official code's (``facebookresearch/VICRegL``, ``main_vicregl.py`` and the README's ResNet-50
command): alpha 0.75, VICReg weights 25 / 25 / 1, eps 1e-4, 20 / 4 location matches, all cells matched by feature
distance; both projectors reduced for CPU: the global one as unison's VICReg (512-512-512; theirs 8192-8192-8192),
the maps projector to 128-128-128 (Lightly's VICRegL example; theirs 512-512-512: ``--param maps_hidden_dim=512
--param maps_dim=512``): the local covariances, one per matched cell, grow as the square of its width. Recipe: the
README's ResNet-50 pre-training, LARS, lr 0.3 per 256 images, weight decay 1e-6, two 224 px crops from 8-100 % of
the image with BYOL's colour operations (their ``get_color_distortion``: blur 1.0 / 0.1, solarisation 0 / 0.2):
unison's ``byol`` preset. Their ConvNeXt setting adds 6 local crops (``--augmentation
multicrop``: unison's multi-crop preset, SimCLR's colour operations). Not done: their ``no_flip_grid`` default,
which leaves the location grid of a flipped crop unflipped (the locations here are where the cells are), and their
online linear classifier (unison evaluates by kNN).

Distributed semantics: the matches are per image and made on the rank that holds it; the invariance terms are means
over this rank's images; every variance and covariance (global embeddings and every set of matched cells) is over
the global batch, gathered with ``all_gather_with_grad`` in one collective (`unison.losses.vicregl`); the maps
projector's batch norm is synchronised like the backbone's. The crops come from (seed, epoch, index) and each
image's size, never from the rank. Exact with gather on and SyncBN (``unison check --method vicregl``).

Example::

    backbone, dim = build_backbone("resnet18", 32)
    model = VICRegL(backbone, dim, VICRegLParams())
    keys = SampleKeys(seed, epoch, indices, crops=augmenter.view_geometry(indices, epoch, seed, sizes))
    loss = model([view_a, view_b], keys=keys)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.losses import VICRegLLoss
from unison.models import mlp
from unison.models.dense import coarse_grid, dense_features, make_dense

from ._common import check_multicrop
from .base import Recipe, SampleKeys, SSLMethod
from .params import check_params, check_trains


@dataclass
class VICRegLParams:
    alpha: float = 0.75             # weight of the global criterion (1 - alpha: the local one)
    proj_hidden_dim: int = 512      # paper: 8192 (reduced for CPU, as unison's VICReg)
    proj_dim: int = 512
    proj_layers: int = 3
    maps_hidden_dim: int = 128      # reduced for CPU, Lightly's example width (paper: 512-512-512)
    maps_dim: int = 128
    maps_layers: int = 3
    sim_weight: float = 25.0        # lambda
    var_weight: float = 25.0        # mu
    cov_weight: float = 1.0         # nu
    eps: float = 1e-4
    num_matches: int = 20           # location matches kept from a global view's cells into the other view
    num_matches_back: int = 4       # ... and from the other view's cells into the global view
    l2_all_matches: bool = True     # feature-distance matching keeps every cell (else num_matches / num_matches_back)
    grid_size: int = 7              # larger feature maps average-pooled to grid_size x grid_size; 0: as they are

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "proj_layers", "maps_hidden_dim", "maps_dim",
                                  "maps_layers", "num_matches", "num_matches_back"),
                     counts=("grid_size",), unit_interval=("alpha",),
                     non_negative=("sim_weight", "var_weight", "cov_weight"), positive=("eps",))
        check_trains(self, {name: getattr(self, name) > 0 for name in ("sim_weight", "var_weight", "cov_weight")})


class VICRegL(SSLMethod):
    name = "vicregl"
    Params = VICRegLParams
    needs_sample_keys = True      # the keys carry each view's crop in its image
    needs_crop_geometry = True
    recipe = Recipe(optimizer="lars", base_lr=0.3, weight_decay=1e-6, augmentation="byol")

    projector: nn.Module | None
    maps_projector: nn.Module | None

    def __init__(self, backbone: nn.Module, feature_dim: int, params: VICRegLParams, **kw):
        super().__init__(make_dense(backbone), feature_dim, params, **kw)
        # alpha 1 / 0 leaves one criterion: no head whose parameters would get no gradient (DDP refuses them)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             bias_last=False) if params.alpha > 0 else None
        self.maps_projector = mlp(feature_dim, params.maps_hidden_dim, params.maps_dim, params.maps_layers,
                                  bias_last=False) if params.alpha < 1 else None
        self.loss_fn = VICRegLLoss(params.sim_weight, params.var_weight, params.cov_weight, params.alpha,
                                   params.num_matches, params.num_matches_back, params.l2_all_matches, params.eps,
                                   gather_distributed=self.gather_distributed)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return dense_features(self.backbone, x, self.feature_dim)[0]

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        n = check_multicrop(views, "VICRegL")
        if keys is None or keys.crops is None:
            raise ValueError("VICRegL needs keys=SampleKeys(..., crops=...): where each view lies in its image "
                             "(unison.data.augment.ViewAugmenter.view_geometry)")
        if keys.crops.shape != (n, len(views), 2, 3):
            raise ValueError(f"VICRegL: crops of shape {tuple(keys.crops.shape)} for {len(views)} views of {n} "
                             f"images; expected {(n, len(views), 2, 3)}")
        embeddings, maps, locations = [], [], []
        for v, x in enumerate(views):
            pooled, grid = dense_features(self.backbone, x, self.feature_dim)
            if self.projector is not None:
                embeddings.append(self.projector(pooled))
            if self.maps_projector is not None:
                cells, centres = coarse_grid(grid, self.params.grid_size)
                maps.append(self.maps_projector(cells.flatten(0, 2)).view(n, centres.shape[0], -1))
                locations.append(cell_locations(keys.crops[:, v], centres))
        return self.loss_fn(embeddings or None, maps or None, locations or None, n_global=2)


def cell_locations(crops: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """float64 [n, cells, 2]: where the cell `centres` [cells, 2] (a view's normalised (x, y)) lie in each image,
    by that view's `crops` [n, 2, 3] (`unison.data.augment.ViewAugmenter.view_geometry`)."""
    points = torch.cat([centres.to(crops), torch.ones_like(centres[:, :1]).to(crops)], dim=1)   # [cells, 3]
    return torch.einsum("nij,cj->nci", crops, points)
