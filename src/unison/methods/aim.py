"""AIM (El-Nouby et al., 2024): autoregressive image models, a prefix-causal ViT predicting the next patch's pixels.

    order:    the N patches of an image in raster order; a prefix length K in [1, N - 1] drawn per sample from
              (seed, epoch, index)
    encoder:  y = ViT(every patch) with prefix-causal attention: a token sees the class token, the K prefix
              patches and every patch before it; the prefix patches see each other bidirectionally
    head:     an MLP applied to each token (a linear layer up to the head's width, residual MLP blocks,
              LayerNorm, a linear layer to the p*p*3 pixels of a patch)
    loss:     AIMLoss: the token before patch j predicts patch j, for every j >= K; squared error against the
              patch standardised by its own mean and variance, a mean per image (`unison.losses.aim`)

The prefix makes the bidirectional encoder the paper evaluates: ``embed(x)`` runs the ViT without a mask (every
token sees every token) and averages its output patch tokens (the paper pools the patch features; its attentive
probe is a separate trained head). AIM's ViT has no class token; unison's ViT keeps its class token (which export
and the other methods read) as the first token of every prefix: always visible, never predicted, so it changes
what a patch may attend to, not what is predicted from what. The positions are the paper's fixed 2-D sin-cos
embedding (``fixed_positions``): the position table of a ViT unison builds is set to it (the class token's to 0,
`AIM.init_backbone`) and frozen; weights ``--init`` loads keep their table, frozen as it is.

Defaults: per-patch normalised targets and prefix attention with K uniform in [1, N - 1] (paper); a head of
2 MLP blocks 256 wide (paper: 12 blocks 2048 wide; reduced for CPU). Recipe: AdamW, lr 1e-3 at a batch of 4096
= 6.25e-5 per 256 images, weight decay 0.05 (paper, as Lightly's AIM benchmark); random resized crops from 40 % of
the image and flips, no colour ops (preset ``aim``, Lightly's ``AIMTransform``); ``vit_tiny_auto``. Not
implemented: AdamW's beta2 = 0.95 (unison's AdamW keeps 0.999), the paper's large-scale data and its attentive
probe.

Lightly's AIM example and benchmark regress every token on its own patch, all patches, prefix included
(``MSELoss(head(features), patches)``); under causal attention a token sees its own patch, so that target is no
prediction. unison predicts the next patch on the non-prefix patches only, as the paper's objective reads.

Distributed semantics: the prefix lengths depend on (seed, epoch, sample index) only; the loss is a mean of
per-sample terms (each image's mean over its N - K predicted patches): each rank returns the mean over its local
samples, so DDP's average is the exact global-batch gradient. Nothing is gathered; there is no batch norm.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = AIM(backbone, dim, AIMParams())
    loss = model([images], keys=SampleKeys(seed=0, epoch=0, indices=sample_indices))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.losses import AIMLoss, patchify
from unison.rng import sample_uniform

from ._common import mean_patch_embedding, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .mae import sincos_positions
from .params import check_params

PREFIX_STREAM = 0x4149_4D00     # + view index: counter-based RNG stream of AIM's prefix lengths


@dataclass
class AIMParams:
    head_dim: int = 256              # paper: 2048 (reduced for CPU)
    head_blocks: int = 2             # paper: 12
    norm_pix: bool = True            # paper: per-patch normalised targets
    fixed_positions: bool = True     # paper: fixed 2-D sin-cos positions

    def __post_init__(self) -> None:
        check_params(self, sizes=("head_dim",), counts=("head_blocks",))


class AIMHeadBlock(nn.Module):
    """x + MLP(LayerNorm(x)), the MLP 4x wide, without biases (the paper's head block)."""

    def __init__(self, dim: int):
        super().__init__()
        from timm.layers import Mlp

        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def aim_head(in_dim: int, dim: int, blocks: int, out_dim: int) -> nn.Sequential:
    """Linear up to `dim`, `blocks` residual MLP blocks, LayerNorm, Linear to `out_dim`; applied to each token."""
    return nn.Sequential(nn.Linear(in_dim, dim, bias=False), *(AIMHeadBlock(dim) for _ in range(blocks)),
                         nn.LayerNorm(dim), nn.Linear(dim, out_dim, bias=False))


def prefix_causal_mask(prefix: torch.Tensor, n_patches: int) -> torch.Tensor:
    """[n, 1, 1 + N, 1 + N] boolean, True where token i (0: the class token, 1 + j: patch j) may attend to token k:
    k <= i (causal) or k <= prefix (the class token and the prefix patches are visible to every token)."""
    seq = torch.arange(1 + n_patches, device=prefix.device)
    causal = seq.unsqueeze(1) >= seq.unsqueeze(0)                                        # [L, L]: k <= i
    visible = seq.view(1, 1, -1) <= prefix.view(-1, 1, 1)                                # [n, 1, L]
    return (causal.unsqueeze(0) | visible).unsqueeze(1)


class AIM(SSLMethod):
    name = "aim"
    accumulation = "plain"   # a mean of per-sample terms, no batch statistics: plain accumulation is exact
    Params = AIMParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=6.25e-5, weight_decay=0.05, augmentation="aim",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 2e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: AIMParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        vit = require_vit(backbone, "AIM")
        if params.fixed_positions:   # the table `init_backbone` wrote, or the one --init loaded: kept as it is
            vit.pos_embed.requires_grad_(False)
        self.head = aim_head(feature_dim, params.head_dim, params.head_blocks, vit.patch_size ** 2 * 3)
        self.loss_fn = AIMLoss(params.norm_pix)

    @classmethod
    def init_backbone(cls, backbone: nn.Module, params: AIMParams) -> None:
        """The paper's fixed 2-D sin-cos positions in the ViT's position table (the class token's: 0)."""
        vit = require_vit(backbone, "AIM")
        if params.fixed_positions:
            with torch.no_grad():
                table = vit.pos_embed[0]
                table[0].zero_()
                table[1:].copy_(sincos_positions(vit.grid, vit.embed_dim, table))

    def prefix_lengths(self, keys: SampleKeys, view: int, n_patches: int, device: torch.device) -> torch.Tensor:
        """K [n] in [1, N - 1], uniform, from each sample's keys."""
        if n_patches < 2:
            raise ConfigError(f"AIM needs at least 2 patches per image (a prefix and a patch to predict), got "
                              f"{n_patches}; use a backbone with smaller patches")
        u = sample_uniform(keys.seed, keys.epoch, keys.indices, PREFIX_STREAM + view, 1)[:, 0].double()
        return (1 + (u * (n_patches - 1)).floor().long()).to(device)

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("AIM draws its prefixes per sample: call it with keys=SampleKeys(seed, epoch, indices)")
        vit = require_vit(self.backbone, "AIM")
        losses = []
        for v, x in enumerate(views):
            n_patches = vit.num_patches(x.shape[-1])
            prefix = self.prefix_lengths(keys, v, n_patches, x.device)
            tokens = vit.forward_tokens(x, attn_mask=prefix_causal_mask(prefix, n_patches))
            pred = self.head(tokens[:, :n_patches])   # token s (the class token, then patch s - 1) predicts patch s
            losses.append(self.loss_fn(pred, patchify(x, vit.patch_size), prefix))
        return torch.stack(losses).mean()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return mean_patch_embedding(self.backbone, x)
