"""MAE (He et al., 2022): a ViT encodes the visible patches, a light decoder reconstructs the masked ones.

    masks:    per sample, a random m = round(mask_ratio * N) of the N patches are masked (75 %)
    encoder:  y = ViT(visible patches + their positions, class token)            (the backbone)
    decoder:  u = Linear(y); the masked positions get a shared mask token; + fixed 2-D sin-cos
              positions; transformer blocks; LayerNorm; Linear -> p*p*3 pixels per patch
    loss:     MAELoss(u at the masked patches, patchify(x) at the masked patches), per-patch
              normalised pixels (``norm_pix``)

Every view of the batch is an independent MAE sample (the recipe's ``crop`` augmentation
makes one view: random resized crop and flip, no colour ops), with its own mask.
``embed(x)`` (kNN, linear probe) is the mean of the encoder's output patch tokens over the
whole image; `unison export` writes the ViT, whose own ``forward`` returns the class token.

Defaults: mask ratio 0.75, norm-pix loss and the sin-cos decoder positions of the paper; the
decoder is narrowed for CPU (128 wide, 4 blocks, 4 heads; paper: 512, 8, 16; as in the paper's
ablation, a deeper decoder gives better frozen features: docs/archive/benchmarks-history.md). Recipe: AdamW,
lr 1.5e-4 per 256 images, weight decay 0.05 (paper), crop-and-flip augmentation, ``vit_tiny_auto``
backbone (its patches from the image size: 4 px at 32 px, 16 px at 224 px).

Distributed semantics: the masks are drawn with `unison.methods.masking.random_masking` from
(seed, epoch, sample index, view), never from the rank, so a sample is masked the same way at
any world size; the loss is a mean of per-sample terms with the same number of masked
patches for every sample, so each rank returns the mean over its local samples and DDP's
average is the exact global-batch gradient. Nothing is gathered; there is no batch norm.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = MAE(backbone, dim, MAEParams())
    loss = model([images], keys=SampleKeys(seed=0, epoch=0, indices=sample_indices))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.losses import MAELoss, patchify

from ._common import mean_patch_embedding, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .masking import random_masking
from .params import check_heads, check_params

MASK_STREAM = 0x4D_4145_00     # + view index: counter-based RNG stream of MAE's masks


def sincos_positions(grid: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings [grid * grid, dim] (MAE / I-JEPA), row-major patches."""
    from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

    return build_sincos2d_pos_embed([grid, grid], dim=dim).to(device=like.device, dtype=like.dtype)


def transformer_blocks(dim: int, depth: int, heads: int) -> nn.ModuleList:
    from timm.models.vision_transformer import Block

    if dim % heads:
        raise ValueError(f"width {dim} is not a multiple of the {heads} attention heads")
    return nn.ModuleList(Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth))


@dataclass
class MAEParams:
    mask_ratio: float = 0.75        # paper
    decoder_dim: int = 128          # paper: 512 (reduced for CPU and small ViTs)
    decoder_depth: int = 4          # paper: 8; on the embedded digits 4 blocks embed as well as 8, 2 worse
    decoder_heads: int = 4          # paper: 16
    norm_pix: bool = True           # paper: per-patch normalised targets

    def __post_init__(self) -> None:
        check_params(self, sizes=("decoder_dim", "decoder_depth", "decoder_heads"), unit_interval=("mask_ratio",))
        check_heads(self, "decoder_dim", "decoder_heads")


class MAE(SSLMethod):
    name = "mae"
    accumulation = "plain"   # a mean of per-sample terms, no batch statistics: plain accumulation is exact
    Params = MAEParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=1.5e-4, weight_decay=0.05, augmentation="crop", backbone="vit_tiny_auto",
                    embedded={"backbone": "vit_nano_p4", "base_lr": 2e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: MAEParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        vit = require_vit(backbone, "MAE")
        d = params.decoder_dim
        self.decoder_embed = nn.Linear(feature_dim, d)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, d))
        nn.init.normal_(self.mask_token, std=0.02)
        self.decoder_blocks = transformer_blocks(d, params.decoder_depth, params.decoder_heads)
        self.decoder_norm = nn.LayerNorm(d)
        self.decoder_pred = nn.Linear(d, vit.patch_size ** 2 * 3)
        self.loss_fn = MAELoss(params.norm_pix)

    def masks(self, keys: SampleKeys, view: int, n_patches: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(visible, masked) patch indices of this view of every sample: [n, N - m], [n, m]."""
        m = round(self.params.mask_ratio * n_patches)
        if not 1 <= m < n_patches:
            raise ConfigError(f"MAE mask_ratio={self.params.mask_ratio} masks {m} of {n_patches} patches; "
                              "at least one patch must be masked and one visible (--param mask_ratio=VALUE)")
        return random_masking(keys, MASK_STREAM + view, n_patches, m, device)

    def decode(self, latent: torch.Tensor, visible: torch.Tensor, masked: torch.Tensor, grid: int) -> torch.Tensor:
        """Pixel predictions [n, m, p*p*3] at the masked patches, from the encoder output [n, 1 + N - m, D]."""
        y = self.decoder_embed(latent)
        n, d = y.shape[0], y.shape[-1]
        full = self.mask_token.to(y.dtype).expand(n, grid * grid, d)
        full = full.scatter(1, visible.unsqueeze(-1).expand(-1, -1, d), y[:, 1:])   # encoder tokens in place
        full = full + sincos_positions(grid, d, y)
        seq = torch.cat([y[:, :1], full], dim=1)
        for block in self.decoder_blocks:
            seq = block(seq)
        seq = self.decoder_norm(seq)[:, 1:]
        return self.decoder_pred(seq.gather(1, masked.unsqueeze(-1).expand(-1, -1, d)))

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError("MAE draws its masks per sample: call it with keys=SampleKeys(seed, epoch, indices)")
        vit = require_vit(self.backbone, "MAE")
        losses = []
        for v, x in enumerate(views):
            grid = vit.grid_size(x.shape[-1])
            visible, masked = self.masks(keys, v, grid * grid, x.device)
            pred = self.decode(vit.forward_tokens(x, keep=visible), visible, masked, grid)
            target = patchify(x, vit.patch_size)
            target = target.gather(1, masked.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
            losses.append(self.loss_fn(pred, target))
        return torch.stack(losses).mean()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return mean_patch_embedding(self.backbone, x)
