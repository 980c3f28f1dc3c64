"""SimMIM (Xie et al., 2022): masked image modelling with the mask tokens in the encoder and a linear pixel head.

    masks:    the ViT's g x g patch grid is cut into mask patches of mask_unit x mask_unit ViT patches; per sample,
              ceil(mask_ratio x (g / mask_unit)^2) of them are masked (60 %), drawn from (seed, epoch, index)
    encoder:  y = ViT(every patch, the masked ones replaced by a learned mask token, + their positions)
    head:     u = Linear(y) -> the p*p*3 pixels of each patch (official: a 1x1 convolution + pixel shuffle)
    loss:     SimMIMLoss(u at the masked patches, their input pixels): L1 (`unison.losses.simmim`)

Mask patch size: the paper masks 32 px squares of a 224 px image for ViT-B/16, 2 x 2 of its 16 px patches
(``MASK_PATCH_SIZE: 32``; the best size of its ablation). Here the mask patch is given in ViT patches,
``mask_unit = 2``: 32 px at 224 px with 16 px patches, and the same 2 x 2 patches (4 x 4 mask patches of the
8 x 8 grid) at the 32 px and 16 px sizes ``vit_tiny_auto`` patches at, where a 32 px square would be the image.

Defaults (official ViT-B pre-training ``simmim_pretrain__vit_base__img224__800ep.yaml``): mask ratio 0.6, mask
patches of 2 x 2 ViT patches, a linear head. Recipe: AdamW, lr 8e-4 at a batch of 2048 = 1e-4 per 256 images (the
paper's; the official configuration writes ``BASE_LR: 1e-4`` per 512), weight decay 0.05, random resized crops
from 67 % of the image and flips, no colour ops (preset ``simmim``), ``vit_tiny_auto``. Not implemented: the
official ViT's layer scale and shared relative position bias (unison's ViT has absolute positions), drop path
0.1, the multi-step schedule (unison's cosine). ``embed(x)`` is the mean of the output patch tokens (the
fine-tuning protocol pools them).

Distributed semantics: the masks depend on (seed, epoch, sample index) only and every sample masks the same number
of patches; the loss is a mean of per-sample terms: each rank returns the mean over its local samples, so DDP's
average is the exact global-batch gradient. Nothing is gathered; there is no batch norm.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = SimMIM(backbone, dim, SimMIMParams())
    loss = model([images], keys=SampleKeys(seed=0, epoch=0, indices=sample_indices))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.losses import SimMIMLoss, patchify

from ._common import mean_patch_embedding, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .masking import random_masking
from .params import check_params

MASK_STREAM = 0x5349_4D00     # + view index: counter-based RNG stream of SimMIM's masks


@dataclass
class SimMIMParams:
    mask_ratio: float = 0.6         # official
    mask_unit: int = 2              # side of a mask patch in ViT patches (official: 32 px on 16 px patches)

    def __post_init__(self) -> None:
        check_params(self, sizes=("mask_unit",), unit_interval=("mask_ratio",))
        if self.mask_ratio == 0:
            raise ConfigError("SimMIM parameter mask_ratio=0 masks nothing: the loss has no patch to reconstruct; "
                              "give a ratio in (0, 1] (--param mask_ratio=0.6)")


def mask_grid(params: SimMIMParams, grid: int) -> tuple[int, int]:
    """(mask patches per side, masked mask patches) on a `grid` x `grid` patch grid; ConfigError where the mask
    patches do not tile the grid."""
    unit = params.mask_unit
    if grid % unit:
        raise ConfigError(f"SimMIM mask patches of {unit} x {unit} ViT patches do not tile the {grid} x {grid} patch "
                          f"grid; give --param mask_unit= a divisor of {grid} (e.g. 1)")
    side = grid // unit
    return side, math.ceil(side * side * params.mask_ratio)   # official MaskGenerator: np.ceil


class SimMIM(SSLMethod):
    name = "simmim"
    accumulation = "plain"   # a mean of per-sample terms, no batch statistics: plain accumulation is exact
    Params = SimMIMParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=1e-4, weight_decay=0.05, augmentation="simmim",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 2e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: SimMIMParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        vit = require_vit(backbone, "SimMIM")
        self.mask_token = nn.Parameter(torch.zeros(1, 1, feature_dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02, a=-0.02, b=0.02)   # official
        self.head = nn.Linear(feature_dim, vit.patch_size ** 2 * 3)
        self.loss_fn = SimMIMLoss()

    @classmethod
    def check_views(cls, params: SimMIMParams, patch: int | None, view_sizes: Sequence[int]) -> None:
        for size in sorted(set(view_sizes)):
            if patch and size % patch == 0:   # other sizes: the ViT's own one-line refusal (`ViT.grid_size`)
                mask_grid(params, size // patch)

    def masked_patches(self, keys: SampleKeys, view: int, grid: int, device: torch.device) -> torch.Tensor:
        """The masked ViT patches of each sample, [n, m * mask_unit^2], ascending (row-major on the grid)."""
        side, count = mask_grid(self.params, grid)
        coarse = random_masking(keys, MASK_STREAM + view, side * side, count, device)[1]     # [n, m]
        unit = self.params.mask_unit
        r, c = coarse // side, coarse % side
        k = torch.arange(unit * unit, device=coarse.device)
        fine = (r.unsqueeze(-1) * unit + k // unit) * grid + c.unsqueeze(-1) * unit + k % unit   # [n, m, u*u]
        return fine.flatten(1).sort(dim=1).values

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("SimMIM draws its masks per sample: call it with keys=SampleKeys(seed, epoch, indices)")
        vit = require_vit(self.backbone, "SimMIM")
        losses = []
        for v, x in enumerate(views):
            grid = vit.grid_size(x.shape[-1])
            masked = self.masked_patches(keys, v, grid, x.device)
            is_masked = torch.zeros(x.shape[0], grid * grid, dtype=torch.bool, device=x.device).scatter_(1, masked, True)
            tokens = vit.forward_tokens(x, mask=is_masked, mask_token=self.mask_token)[:, 1:]
            at_masked = masked.unsqueeze(-1)
            pred = self.head(tokens.gather(1, at_masked.expand(-1, -1, tokens.shape[-1])))
            target = patchify(x, vit.patch_size)
            losses.append(self.loss_fn(pred, target.gather(1, at_masked.expand(-1, -1, target.shape[-1]))))
        return torch.stack(losses).mean()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return mean_patch_embedding(self.backbone, x)
