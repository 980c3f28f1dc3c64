"""Lightly SSL's side of `unison bench lightly` for the dense methods, built only from Lightly's own pieces.

VICRegL and DenseCL follow Lightly's examples (``examples/pytorch/vicregl.py``, ``examples/pytorch/densecl.py``):
VICRegL with ``BarlowTwinsProjectionHead`` (2048 wide), ``VicRegLLocalProjectionHead`` (128 wide), ``VICRegLLoss``
and ``VICRegLTransform`` with no local views (its advice for ResNets; unison's recipe trains 2 views too), its grid
as large as the backbone's feature map at the image size, and the example's SGD (0.06 x batch / 128, momentum 0.9,
no weight decay); DenseCL with two ``DenseCLProjectionHead`` (512 wide, to 128), ``select_most_similar``, two
``NTXentLoss`` memory banks of 4096 and ``DenseCLTransform``, the example's cosine momentum from 0.996 (per step),
and the SGD of Lightly's CIFAR-10 benchmark for MoCo, which DenseCL extends (the example's plain SGD without momentum
is a demo setting). The example's key encoder calls the online backbone and heads, which leaves its momentum copies
unused; here the copies encode the keys, as the example's momentum updates intend. Both need the backbone's feature
map: the shared backbone loses its pooling (`unison.models.dense.make_dense`, no parameters change) inside
`DenseBackbone`, which gives the pooled feature as before (what the kNN evaluates) and the map.

Example::

    side = VICRegLSide(backbone, 512)        # with VICRegLTransform(global_grid_size=map_side(backbone, 512, 32))
    loss = side.training_loss(views_and_grids, step, total_steps)
"""

from __future__ import annotations

import copy
from typing import cast

import torch
import torch.nn as nn

from unison.models.dense import dense_features, make_dense

from .lightly_models import Side, lightly_momentum_copy

__all__ = ["DenseBackbone", "DenseCLSide", "DenseSide", "VICRegLSide", "map_side"]


class DenseBackbone(nn.Module):
    """The shared backbone without its pooling: ``forward`` gives the pooled feature as before (kNN), ``maps`` the
    (pooled feature, feature map [B, C, h, w]) of one call, as Lightly's examples take a ResNet's trunk."""

    def __init__(self, backbone: nn.Module, dim: int):
        super().__init__()
        self.net, self.dim = make_dense(backbone), dim

    def maps(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, grid = dense_features(self.net, x, self.dim)
        return pooled, grid.permute(0, 3, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maps(x)[0]


def map_side(backbone: nn.Module, dim: int, image_size: int) -> int:
    """The side of `backbone`'s feature map at `image_size` px (the grid Lightly's VICRegL transform must draw)."""
    dense = DenseBackbone(copy.deepcopy(backbone), dim).eval()
    with torch.no_grad():
        return int(dense.maps(torch.zeros(1, 3, image_size, image_size))[1].shape[-1])


class DenseSide(Side):
    """A Lightly side whose backbone is the shared one without its pooling (`DenseBackbone`)."""

    backbone: DenseBackbone

    def __init__(self, backbone: nn.Module, dim: int):
        super().__init__(DenseBackbone(backbone, dim))


class VICRegLSide(DenseSide):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import VICRegLLoss
        from lightly.models.modules import BarlowTwinsProjectionHead
        from lightly.models.modules.heads import VicRegLLocalProjectionHead

        super().__init__(backbone, dim)
        self.projection_head = BarlowTwinsProjectionHead(dim, 2048, 2048)
        self.local_projection_head = VicRegLLocalProjectionHead(dim, 128, 128)
        self.criterion = VICRegLLoss()

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        images, grids = views[:len(views) // 2], views[len(views) // 2:]
        features = []
        for x in images:
            pooled, maps = self.backbone.maps(x)
            features.append((self.projection_head(pooled), self.local_projection_head(maps.permute(0, 2, 3, 1))))
        return self.criterion(global_view_features=features, global_view_grids=grids)


class DenseCLSide(DenseSide):
    def __init__(self, backbone: nn.Module, dim: int):
        from lightly.loss import NTXentLoss
        from lightly.models.modules import DenseCLProjectionHead

        super().__init__(backbone, dim)
        self.projection_head_global = DenseCLProjectionHead(dim, 512, 128)
        self.projection_head_local = DenseCLProjectionHead(dim, 512, 128)
        self.backbone_momentum = cast(DenseBackbone, lightly_momentum_copy(self.backbone))
        self.projection_head_global_momentum = lightly_momentum_copy(self.projection_head_global)
        self.projection_head_local_momentum = lightly_momentum_copy(self.projection_head_local)
        self.criterion_global = NTXentLoss(memory_bank_size=(4096, 128))
        self.criterion_local = NTXentLoss(memory_bank_size=(4096, 128))

    @staticmethod
    def _encode(backbone: DenseBackbone, head_global: nn.Module, head_local: nn.Module,
                x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pooled, maps = backbone.maps(x)
        cells = maps.flatten(start_dim=2).permute(0, 2, 1)   # (B, H*W, C), as the example's
        return cells, head_global(pooled), head_local(cells)

    def training_loss(self, views: list[torch.Tensor], step: int, steps: int) -> torch.Tensor:
        from lightly.models import utils
        from lightly.utils.scheduler import cosine_schedule

        momentum = cosine_schedule(step, steps, 0.996, 1)
        utils.update_momentum(self.backbone, self.backbone_momentum, m=momentum)
        utils.update_momentum(self.projection_head_global, self.projection_head_global_momentum, m=momentum)
        utils.update_momentum(self.projection_head_local, self.projection_head_local_momentum, m=momentum)
        x_query, x_key = views
        query_features, query_global, query_local = self._encode(
            self.backbone, self.projection_head_global, self.projection_head_local, x_query)
        with torch.no_grad():
            key_features, key_global, key_local = self._encode(
                self.backbone_momentum, self.projection_head_global_momentum, self.projection_head_local_momentum,
                x_key)
        key_local = utils.select_most_similar(query_features, key_features, key_local)
        loss_global = self.criterion_global(query_global, key_global)
        loss_local = self.criterion_local(query_local.flatten(end_dim=1), key_local.flatten(end_dim=1))
        return 0.5 * (loss_global + loss_local)
