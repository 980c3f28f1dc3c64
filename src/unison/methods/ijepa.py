"""I-JEPA (Assran et al., 2023): predict the target encoder's embeddings of masked blocks from a context block.

    masks:     per sample, M = 4 target blocks of h x w patches (or w x h) and a context of the
               other patches (`unison.methods.masking.block_masking`)
    context:   c = ViT(context patches + their positions)                  (the backbone, trained)
    targets:   s = LayerNorm(ViT'(all patches)) at each block's patches      (EMA of the backbone, no gradient)
    predictor: for each block, [Linear(c) + pos(context); mask token + pos(block)] -> narrow
               transformer -> LayerNorm -> Linear to D, at the block's positions (fixed 2-D sin-cos pos)
    loss:      IJEPALoss(predicted, s) (mean over blocks and patches of the squared L2 distance)
    ViT'     <- m ViT' + (1 - m) ViT,  m from 0.996 to 1 linearly over the run (paper)

Block size: K = round(target_scale * N) patches (paper: 15-20 % of the image per block;
default 0.175) with aspect ratio about ``target_aspect`` (paper: 0.75-1.5): h = round(sqrt(K *
aspect)), w = round(K / h), transposed per block at random. The context holds the
N - M h w patches left (see `block_masking` for how this differs from the paper's context
block). The class token of unison's ViT takes part in the encoders' attention; the loss
reads patch tokens only. ``embed(x)`` is the mean of the patch tokens (the paper's
evaluation protocol averages them).

Defaults: 4 targets, predictor 128 wide, 4 blocks, 4 heads (paper: 384 wide, 6-12 blocks,
for ViT-H); AdamW lr 1e-3 per 2048 images = 1.25e-4 per 256, weight decay 0.04 (paper; its
0.04 -> 0.4 schedule is not implemented), crop-and-flip augmentation, ``vit_tiny_auto``
backbone (patches from the image size: 8 x 8 of 4 px at 32 px, 14 x 14 of 16 px at 224 px; the four
target blocks leave a context at 8 x 8 already, and 2 px patches at 224 px would be 12,544 tokens).

Distributed semantics: the masks depend on (seed, epoch, sample index, view) only, every
sample has the same numbers of target and context patches, and the loss is a mean of
per-sample terms: each rank returns the mean over its local samples, so DDP's average is the
exact global-batch gradient. Nothing is gathered and there is no batch norm. The target
encoder and the step counter are rank-local state (a `MomentumTeacher`, saved in checkpoints,
copied from rank 0 on the first forward).

Example::

    backbone, dim = build_backbone("vit_tiny_p2")
    model = IJEPA(backbone, dim, IJEPAParams(), steps_total=10_000)
    loss = model([images], keys=SampleKeys(seed, epoch, indices)); ...; model.on_after_step(step)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import IJEPALoss

from ._common import mean_patch_embedding, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .mae import sincos_positions, transformer_blocks
from .masking import block_masking
from .params import check_heads, check_params
from .teacher import MomentumTeacher

MASK_STREAM = 0x494A_0000     # + 2 * view (+1): counter-based RNG streams of I-JEPA's blocks


@dataclass
class IJEPAParams:
    num_targets: int = 4             # paper
    target_scale: float = 0.175      # share of the patches per target block (paper: 0.15-0.2)
    target_aspect: float = 1.5       # h / w of a block, transposed at random (paper: 0.75-1.5)
    predictor_dim: int = 128         # paper: 384 (reduced for CPU)
    predictor_depth: int = 4         # paper: 6 (ViT-B/L), 12 (ViT-H)
    predictor_heads: int = 4
    momentum_base: float = 0.996     # paper: 0.996 -> 1.0, linearly

    def __post_init__(self) -> None:
        check_params(self, sizes=("num_targets", "predictor_dim", "predictor_depth", "predictor_heads"),
                     positive=("target_aspect",), unit_interval=("target_scale", "momentum_base"))
        check_heads(self, "predictor_dim", "predictor_heads")


class IJEPAPredictor(nn.Module):
    """Context tokens + mask tokens at a block's positions -> predicted embeddings of the block."""

    def __init__(self, embed_dim: int, dim: int, depth: int, heads: int):
        super().__init__()
        self.embed = nn.Linear(embed_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.blocks = transformer_blocks(dim, depth, heads)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, embed_dim)

    def forward(self, context: torch.Tensor, context_idx: torch.Tensor, targets: torch.Tensor,
                grid: int) -> torch.Tensor:
        """context [n, c, D] at patches context_idx [n, c]; targets [n, M, K] -> predictions [n, M, K, D]."""
        n, m, k = targets.shape
        c = self.embed(context)
        pos = sincos_positions(grid, c.shape[-1], c)                      # [N, d]
        c = (c + pos[context_idx]).repeat_interleave(m, dim=0)            # [n M, c, d], one copy per block
        q = self.mask_token.to(c.dtype) + pos[targets.reshape(n * m, k)]  # [n M, K, d]
        x = torch.cat([c, q], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.proj(self.norm(x[:, -k:])).view(n, m, k, -1)


def target_block(p: IJEPAParams, grid: int) -> tuple[int, int]:
    """(h, w) of a target block on a `grid` x `grid` patch grid; ConfigError if no context would be left."""
    n_patches = grid * grid
    k = max(1, round(p.target_scale * n_patches))
    h = min(grid, max(1, round(math.sqrt(k * p.target_aspect))))
    w = min(grid, max(1, round(k / h)))
    if p.num_targets * h * w >= n_patches:
        raise ConfigError(f"I-JEPA: {p.num_targets} target blocks of {h} x {w} patches cover the {grid} x {grid} "
                          f"patches of the image, no context is left; use a backbone with smaller patches "
                          f"(vit_*_p2 for 16 px images) or fewer / smaller targets (--param num_targets=2, "
                          f"--param target_scale=0.1)")
    return h, w


class IJEPA(SSLMethod):
    step_count: torch.Tensor
    name = "ijepa"
    accumulation = "plain"   # a mean of per-sample terms, no batch statistics: plain accumulation is exact
    Params = IJEPAParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=1.25e-4, weight_decay=0.04, augmentation="crop",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p2", "base_lr": 1e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: IJEPAParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        require_vit(backbone, "I-JEPA")
        self.predictor = IJEPAPredictor(feature_dim, params.predictor_dim, params.predictor_depth,
                                        params.predictor_heads)
        self.target = MomentumTeacher(backbone=self.backbone)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = IJEPALoss()

    @classmethod
    def check_views(cls, params: IJEPAParams, patch: int | None, view_sizes: Sequence[int]) -> None:
        for size in sorted(set(view_sizes)):
            if patch and size % patch == 0:   # other sizes: the ViT's own one-line refusal (`ViT.grid_size`)
                target_block(params, size // patch)

    def block_shape(self, grid: int) -> tuple[int, int]:
        return target_block(self.params, grid)

    def momentum(self, step: float) -> float:
        base, step = self.params.momentum_base, self.schedule_step(step)
        return base + (1 - base) * min(max(step / max(self.steps_total, 1), 0.0), 1.0)

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("I-JEPA draws its masks per sample: call it with keys=SampleKeys(seed, epoch, indices)")
        self.target.sync_once()
        vit, target_vit = require_vit(self.backbone, "I-JEPA"), require_vit(self.target.backbone, "I-JEPA")
        losses = []
        for v, x in enumerate(views):
            grid = vit.grid_size(x.shape[-1])
            targets, context = block_masking(keys, MASK_STREAM + 2 * v, grid, self.params.num_targets,
                                             self.block_shape(grid), x.device)
            n, m, k = targets.shape
            with torch.no_grad():
                s = target_vit.forward_tokens(x)[:, 1:]
                s = F.layer_norm(s, s.shape[-1:])
                s = s.gather(1, targets.reshape(n, m * k, 1).expand(-1, -1, s.shape[-1])).view(n, m, k, -1)
            c = vit.forward_tokens(x, keep=context)[:, 1:]
            losses.append(self.loss_fn(self.predictor(c, context, targets, grid), s))
        return torch.stack(losses).mean()

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.target.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return mean_patch_embedding(self.backbone, x)
