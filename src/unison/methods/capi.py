"""CAPI (Darcet et al., 2025): predict, for masked patches, the online clustering of a teacher's patch features.

    masks:      per sample, m = int(mask_ratio * N) patches masked: one block of the other N - m stays visible
                (inverse block masking, rolled around the grid: `unison.methods.masking.inverse_block_masking`);
                the predictor answers at M = max(1, int(prediction_subsampling * m)) of the masked patches
    student:    y = ViT(visible patches, class token)                                     (the backbone, trained)
                u = predictor(mask tokens at the M patches, cross-attending to y)          (trained)
                s = head(u): L2-normalised, K weight-normalised prototypes with learned norms    (trained)
    teacher:    t = ViT'(all patches) patch tokens, ViT' an EMA of the backbone             (no gradient)
                l = clustering(t): L2-normalised, K prototypes and a bias                  (trained by L_clust)
    loss   =    L_capi + L_clust: cross-entropy of s against the positionwise Sinkhorn-Knopp assignment of l at
                the M patches, and of l itself against it at every patch (`unison.losses.capi`)
    ViT'   <-   m ViT' + (1 - m) ViT,  m: 1 -> momentum_base linearly over the first momentum_warmup_fraction of the
                steps, then a cosine back towards 1, cut at 0.8 of its half period (official ``WarmupThenCosine``)

The predictor is the official decoder: blocks of cross-attention (the queries attend to the encoder's tokens only,
never to each other, so each masked patch is predicted on its own) and an MLP, pre-normalised with RMSNorm,
without biases, as wide as the backbone and with its heads; a final RMSNorm without affine. Positions: unison's ViT
carries learned absolute positions (official: 2-D RoPE in every attention, and 16 registers instead of a class
token), and the predictor adds fixed 2-D sin-cos positions to its queries and to the visible tokens it reads.
``embed(x)`` is the mean of the encoder's patch tokens over the whole image.

Defaults (official ViT-L/14 configuration ``default_pretrain_config.yaml``): mask ratio 0.65, temperatures 0.12
(student, clustering) and 0.06 (Sinkhorn targets), 3 Sinkhorn iterations, momentum 0.999 with a warm-up from 1 over
10 % of the steps; K = 1024 clusters and 4 predictor blocks (official 16384 and 12, reduced for CPU); every
masked patch predicted (official: 5 % of them, which at ViT-L/14's 16 x 16 patches is 8 an image and at 8 x 8
would be 2). Recipe: AdamW, lr 1e-3 at the official global batch of 16384 = 1.5625e-5 per 256 images, weight decay 0.1,
crops from 60 % and flips (preset ``capi``), ``vit_tiny_auto``; on the embedded digits ``vit_nano_p4`` and lr 1e-3, the
short-schedule setting of the other ViT methods (on ``vit_nano_p2``'s 8 x 8 patches the representation collapses
within the digits' 150 steps). The clustering head is trained with the same
optimizer and schedule as the student (official: its own AdamW, lr 5e-4 with the same warm-up). Not implemented:
AdamW's betas (0.9, 0.95), the lr multipliers of the patch embedding (0.2) and the weight-decay factor of the
norms (0.1), the cosine cut at 0.8 for the learning rate, drop-path 0.2.

Distributed semantics: masks and predicted patches depend on (seed, epoch, sample index, view) only, and every
sample has the same counts; Sinkhorn-Knopp balances every position over the GLOBAL batch (its maximum and sums
all-reduced, `unison.losses.capi`); both losses are means of per-token terms, so each rank's local mean averaged
by DDP is the global loss and gradient. The clustering head and the predictor are ordinary parameters (DDP
averages their gradients). Exact with gather on. The teacher is rank-local state (a `MomentumTeacher`, saved in
checkpoints, copied from rank 0 on the first forward), updated identically on every rank.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = CAPI(backbone, dim, CAPIParams(), steps_total=10_000)
    loss = model([images], keys=SampleKeys(seed, epoch, indices)); ...; model.on_after_step(step)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.errors import ConfigError
from unison.losses import CAPILoss
from unison.rng import sample_uniform

from ._common import mean_patch_embedding, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .mae import sincos_positions
from .masking import inverse_block_masking
from .params import check_params
from .teacher import MomentumTeacher

MASK_STREAM = 0xCA91_0000     # + 2 * view (+1: the predicted patches): counter-based RNG streams of CAPI's masks
COSINE_CUT = 0.8              # official ``truncate_cos``: the momentum's cosine stops at 0.8 of its half period


@dataclass
class CAPIParams:
    n_clusters: int = 1024               # official num_clusters: 16384 (reduced for CPU)
    mask_ratio: float = 0.65             # official
    prediction_subsampling: float = 1.0  # official: 0.05 (a speed-up at 16 x 16 patches and a batch of 16384)
    predictor_depth: int = 4             # official: 12 (half of ViT-L's 24 blocks; reduced for CPU)
    student_temp: float = 0.12           # official
    teacher_temp: float = 0.06           # official target_temp (the Sinkhorn targets)
    clustering_temp: float = 0.12        # official pred_temp (the clustering head's own predictions)
    sinkhorn_iterations: int = 3         # official n_sk_iter
    momentum_base: float = 0.999         # official, reached after the warm-up from 1
    momentum_warmup_fraction: float = 0.1   # official: 50k of 500k iterations

    def __post_init__(self) -> None:
        check_params(self, sizes=("predictor_depth", "sinkhorn_iterations"), classes=("n_clusters",),
                     temperatures=("student_temp", "teacher_temp", "clustering_temp"),
                     unit_interval=("mask_ratio", "prediction_subsampling", "momentum_base",
                                    "momentum_warmup_fraction"))
        if self.prediction_subsampling <= 0:
            raise ConfigError(f"CAPI parameter prediction_subsampling={self.prediction_subsampling} predicts no "
                              "masked patch; give a fraction in (0, 1] (--param prediction_subsampling=1)")


def masked_count(params: CAPIParams, n_patches: int) -> int:
    """How many of `n_patches` patches CAPI masks (official ``int(n_tokens * mask_ratio)``); ConfigError unless
    at least one is masked and one stays visible."""
    m = int(n_patches * params.mask_ratio)
    if not 1 <= m < n_patches:
        raise ConfigError(f"CAPI mask_ratio={params.mask_ratio} masks {m} of {n_patches} patches; at least one patch "
                          "must be masked and one visible (--param mask_ratio=VALUE, or smaller patches)")
    return m


class CrossAttentionBlock(nn.Module):
    """x <- x + proj(attention(RMSNorm(x) -> context)); x <- x + MLP(RMSNorm(x)) (no biases, as the official)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not a multiple of the {heads} attention heads")
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim, eps=1e-5)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim, eps=1e-5)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, dim, bias=False))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        n, m, d = x.shape
        h = self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n, t.shape[1], h, d // h).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(self.norm1(x))), split(self.k(context)), split(self.v(context)))
        x = x + self.proj(a.transpose(1, 2).reshape(n, m, d))
        return x + self.mlp(self.norm2(x))


class CAPIPredictor(nn.Module):
    """Mask tokens at the predicted patches, cross-attending to the encoder's tokens -> predictions [n, M, D]."""

    def __init__(self, dim: int, depth: int, heads: int):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList(CrossAttentionBlock(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim, eps=1e-5, elementwise_affine=False)
        for module in self.blocks.modules():   # official ``_init_weights``: Xavier-uniform linear layers
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, tokens: torch.Tensor, visible: torch.Tensor, predicted: torch.Tensor, grid: int) -> torch.Tensor:
        """tokens [n, 1 + V, D] (class token first) of the patches `visible` [n, V]; predicted [n, M]."""
        pos = sincos_positions(grid, tokens.shape[-1], tokens)                          # [N, D]
        context = torch.cat([tokens[:, :1], tokens[:, 1:] + pos[visible]], dim=1)
        x = self.mask_token.to(tokens.dtype) + pos[predicted]
        for block in self.blocks:
            x = block(x, context)
        return self.norm(x)


class CAPIHead(nn.Module):
    """The student head (official ``L2NormLinear``): logits_k = g_k <x / |x|, v_k / |v_k|>, prototypes v [K, D]
    (truncated normal, std 0.02) with learned norms g (from 1)."""

    def __init__(self, dim: int, n_clusters: int):
        super().__init__()
        self.weight_v = nn.Parameter(torch.empty(n_clusters, dim))
        self.weight_g = nn.Parameter(torch.ones(n_clusters, 1))
        nn.init.trunc_normal_(self.weight_v, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_v * (self.weight_g / (self.weight_v.norm(dim=1, keepdim=True) + 1e-8))
        return F.linear(F.normalize(x, dim=-1), weight)


class OnlineClustering(nn.Module):
    """The teacher-side clustering head (official ``OnlineClustering``): logits = <t / |t|, w_k> + b_k, prototypes w
    [K, D] from a standard normal, biases from 0; trained by the clustering loss only."""

    def __init__(self, dim: int, n_clusters: int):
        super().__init__()
        self.layer = nn.Linear(dim, n_clusters)
        nn.init.normal_(self.layer.weight, std=1.0)
        nn.init.zeros_(self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(F.normalize(x, dim=-1, eps=1e-7))


class CAPI(SSLMethod):
    name = "capi"
    Params = CAPIParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=1.5625e-5, weight_decay=0.1, augmentation="capi",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 1e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: CAPIParams, **kw: Any):
        super().__init__(backbone, feature_dim, params, **kw)
        vit = require_vit(backbone, "CAPI")
        heads = int(cast(Any, vit.blocks[0]).attn.num_heads)
        self.predictor = CAPIPredictor(feature_dim, params.predictor_depth, heads)
        self.head = CAPIHead(feature_dim, params.n_clusters)
        self.clustering = OnlineClustering(feature_dim, params.n_clusters)
        self.teacher = MomentumTeacher(backbone=self.backbone)
        self.loss_fn = CAPILoss(params.teacher_temp, params.student_temp, params.clustering_temp,
                                params.sinkhorn_iterations, gather_distributed=self.gather_distributed)

    @classmethod
    def check_views(cls, params: CAPIParams, patch: int | None, view_sizes: Sequence[int]) -> None:
        for size in sorted(set(view_sizes)):
            if patch and size % patch == 0:   # other sizes: the ViT's own one-line refusal (`ViT.grid_size`)
                masked_count(params, (size // patch) ** 2)

    def masks(self, keys: SampleKeys, view: int, grid: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(visible [n, N - m], masked [n, m], predicted [n, M]) patch indices of this view of every sample."""
        p = self.params
        m = masked_count(p, grid * grid)
        visible, masked = inverse_block_masking(keys, MASK_STREAM + 2 * view, grid, m, device=device)
        count = max(1, int(m * p.prediction_subsampling))
        if count == m:
            return visible, masked, masked
        u = sample_uniform(keys.seed, keys.epoch, keys.indices, MASK_STREAM + 2 * view + 1, m).to(device)
        pick = u.argsort(dim=1, stable=True)[:, :count]
        return visible, masked, masked.gather(1, pick).sort(dim=1).values

    def momentum(self, step: float) -> float:
        """The teacher's EMA momentum after optimiser step `step` (official ``WarmupThenCosine``: 1 -> momentum_base
        linearly over the warm-up, then a cosine cut at `COSINE_CUT` towards 1; 1 from the end of the run)."""
        base, step = self.params.momentum_base, self.schedule_step(step)
        total = max(self.steps_total, 1)
        if step >= total:
            return 1.0
        warmup = round(self.params.momentum_warmup_fraction * total)
        if step < warmup:
            return 1.0 + (base - 1.0) * step / max(warmup - 1, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return 1.0 - (1.0 - base) * (1 + math.cos(math.pi * COSINE_CUT * progress)) / 2

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("CAPI draws its masks per sample: call it with keys=SampleKeys(seed, epoch, indices)")
        vit, teacher_vit = require_vit(self.backbone, "CAPI"), require_vit(self.teacher.backbone, "CAPI")
        self.teacher.sync_once()
        losses = []
        for v, x in enumerate(views):
            grid = vit.grid_size(x.shape[-1])
            visible, _, predicted = self.masks(keys, v, grid, x.device)
            with torch.no_grad():
                features = teacher_vit.forward_tokens(x)[:, 1:]
            teacher_logits = self.clustering(features)              # the clustering head's only gradient
            tokens = vit.forward_tokens(x, keep=visible)
            student_logits = self.head(self.predictor(tokens, visible, predicted, grid))
            loss_capi, loss_clust = self.loss_fn(teacher_logits, student_logits, predicted)
            losses.append(loss_capi + loss_clust)
        return torch.stack(losses).mean()

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.teacher.update(self, self.momentum(step))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return mean_patch_embedding(self.backbone, x)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: Sinkhorn-Knopp balances each rank's local batch"
        return None
