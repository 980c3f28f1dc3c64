"""Dense (per-location) features of any backbone: what distillation matches, location by location.

`build_backbone` modules return one pooled vector per image. Distillation (`unison.methods.distill`) also
needs the feature map the pooling summarises, with gradients, from one call of the backbone (so that
FSDP's parameter gathering and exact accumulation's interception, both hooked on the backbone's
``forward``/``forward_tokens``, see it). `make_dense(backbone)` therefore removes the global pooling in
place where the backbone has one (it holds no parameters: the state dict, exports and checkpoints are
unchanged), and `dense_features(backbone, x, dim)` returns both views of one call:

* unison ViTs: ``forward_tokens`` (nothing removed); the pooled feature is the class token or the patch
  mean, as ``forward`` gives it; the map is the patch tokens on their grid;
* ``small_cnn`` and torchvision ResNets: the final ``AdaptiveAvgPool2d`` becomes ``nn.Identity``, so the
  call returns the flattened map [B, C*h*w]; the pooled feature is its spatial mean (what the pool gave);
* timm models: ``reset_classifier(0, "")`` (no pooling): a CNN returns [B, C, h, w], a ViT its tokens
  [B, prefix + h*w, D] (the pooled feature is then the first prefix token, else the patch mean).

`coarse_grid(grid, size)` bounds the cells a dense loss compares (VICRegL's and DenseCL's pairs of cells grow as the
square of their number: 56 x 56 cells of the small CNN at 224 px would be 10 million pairs per image): larger maps
are average-pooled (adaptively) to ``size x size``, and the centre of each resulting cell in the view's normalised
coordinates comes with it (where VICRegL locates the cell in the image).

Example::

    net, dim = build_backbone("resnet18", 32)
    make_dense(net)
    pooled, grid = dense_features(net, images, dim)    # [B, 512], [B, 4, 4, 512] (CIFAR stem at 32 px)
    cells, centres = coarse_grid(grid, 7)              # as is (4 <= 7), centres [16, 2] in [-1, 1]
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backbones import SmallCNN
from .vit import ViT

__all__ = ["coarse_grid", "dense_features", "make_dense"]


def make_dense(backbone: nn.Module) -> nn.Module:
    """Make ``backbone(x)`` return its feature map instead of the pooled feature (in place; returns it).
    Raises ValueError for a backbone whose pooling it does not know."""
    if isinstance(backbone, ViT):
        return backbone
    if isinstance(backbone, SmallCNN):
        pool = backbone.features[-2]
        if isinstance(pool, nn.AdaptiveAvgPool2d):
            backbone.features[-2] = nn.Identity()
        return backbone
    reset = getattr(backbone, "reset_classifier", None)
    if callable(reset) and hasattr(backbone, "forward_features"):   # timm
        reset(0, "")
        return backbone
    if isinstance(getattr(backbone, "avgpool", None), (nn.AdaptiveAvgPool2d, nn.Identity)):   # torchvision ResNet
        backbone.avgpool = nn.Identity()
        return backbone
    raise ValueError(f"no dense feature map known for {type(backbone).__name__}; use small_cnn, a ResNet, a unison "
                     "ViT or a timm model")


def dense_features(backbone: nn.Module, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled [B, dim], map [B, h, w, dim]) of `x` from one call of a `make_dense` backbone of width `dim`."""
    if isinstance(backbone, ViT):
        tokens = backbone.forward_tokens(x)
        patches = tokens[:, 1:]
        pooled = tokens[:, 0] if backbone.pool == "cls" else patches.mean(dim=1)
        return pooled, _grid(patches)
    out = backbone(x)
    if out.dim() == 2:   # a flattened [B, C*h*w] map (torchvision's flatten after the removed pool)
        hw = out.shape[1] // dim
        side = math.isqrt(hw)
        if side * side * dim != out.shape[1]:
            raise ValueError(f"a dense output of {out.shape[1]} values is no square map of {dim} channels")
        out = out.reshape(out.shape[0], dim, side, side)
    if out.dim() == 4:   # [B, C, h, w]
        grid = out.permute(0, 2, 3, 1)
        return grid.mean(dim=(1, 2)), grid
    if out.dim() == 3:   # timm ViT tokens [B, prefix + h*w, D]
        prefix = int(getattr(backbone, "num_prefix_tokens", 0))
        patches = out[:, prefix:]
        return (out[:, 0] if prefix else patches.mean(dim=1)), _grid(patches)
    raise ValueError(f"unexpected dense output of shape {tuple(out.shape)}")


def _grid(patches: torch.Tensor) -> torch.Tensor:
    """[B, N, D] row-major patch tokens as [B, sqrt(N), sqrt(N), D]."""
    side = math.isqrt(patches.shape[1])
    if side * side != patches.shape[1]:
        raise ValueError(f"{patches.shape[1]} patch tokens are no square grid")
    return patches.reshape(patches.shape[0], side, side, patches.shape[2])


def coarse_grid(grid: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(`grid` [B, h, w, C] with at most `size` cells a side, average-pooled adaptively where it has more; 0: as it
    is), and the centre of each of its cells in the view's normalised coordinates, float64 [cells, 2] as (x, y) in
    [-1, 1], rows in raster order: a pooled cell's centre is its pooling window's."""
    h, w = grid.shape[1:3]
    out_h, out_w = (min(h, size), min(w, size)) if size else (h, w)
    if (out_h, out_w) != (h, w):
        grid = F.adaptive_avg_pool2d(grid.permute(0, 3, 1, 2), (out_h, out_w)).permute(0, 2, 3, 1)
    ys, xs = _window_centres(h, out_h), _window_centres(w, out_w)
    cy, cx = torch.meshgrid(ys, xs, indexing="ij")
    return grid, torch.stack((cx, cy), -1).reshape(-1, 2).to(grid.device)


def _window_centres(n: int, out: int) -> torch.Tensor:
    """Centres, in [-1, 1], of the `out` windows adaptive average pooling takes over `n` cells spanning [-1, 1]:
    window i covers cells floor(i n / out) .. ceil((i + 1) n / out) - 1."""
    i = torch.arange(out, dtype=torch.float64)
    start, end = torch.floor(i * n / out), torch.ceil((i + 1) * n / out)
    return (start + end) / n - 1
