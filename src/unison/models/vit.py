"""Vision Transformers for the ViT-era methods (MAE, iBOT, I-JEPA, LeJEPA, MoCo v3, MSN, SimMIM, AIM), from timm's parts.

`ViT` takes the patch embedding, class token, positional embedding, transformer blocks and
final norm of a timm ``VisionTransformer`` and exposes what masked-image methods need,
which timm's ``forward`` does not:

* ``patch_tokens(x)``: the patch embeddings with their positional embedding, [B, N, D];
* ``forward_tokens(x, keep=None, mask=None, mask_token=None, attn_mask=None)``: the encoder on all patches, on
  a per-sample subset ``keep`` [B, n] of patch indices (MAE, I-JEPA context), or with the
  patches where ``mask`` [B, N] is True replaced by ``mask_token`` (iBOT, SimMIM), and with an
  attention mask ``attn_mask`` [B, 1, 1 + n, 1 + n] (True: query row may attend to key column; AIM's prefix-causal
  attention) given to every block; returns the normalised tokens [B, 1 + n, D], class token first;
* ``forward(x)``: the pooled feature [B, D] (the class token, or the mean of the patch tokens
  with ``pool="mean"``); this is what kNN evaluation and `unison export` use.

``blocks`` is an ``nn.ModuleList`` of timm ``Block`` modules, one per layer, so that a
sharding wrapper can wrap each block separately. Images of another size than ``img_size``
(multi-crop local views) get a bicubically resampled positional embedding (as
``timm.layers.resample_abs_pos_embed``, in the parameter's precision); the size must be a
multiple of the patch size.
The parameter names are timm's (``patch_embed.proj.weight``, ``cls_token``, ``pos_embed``,
``blocks.0.attn.qkv.weight``, ``norm.weight``), so an exported state dict loads, strictly, into
``timm.models.vision_transformer.VisionTransformer(**vit_timm_kwargs(name))`` (``vit_tiny_p4``: ``img_size=32,
patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=0``), whose forward gives the same feature.

Why timm (a dependency, ``timm>=1.0.16``, whose ``Block`` takes an attention mask): its ``Block`` (fused attention
through ``F.scaled_dot_product_attention``), ``PatchEmbed`` and ViT initialisation are the reference
implementations that MAE, DINOv2, I-JEPA and MoCo v3 build on; only the token-level
forward above is written here.

Sizes (`VIT_SIZES`; embedding dim / depth / heads): ``micro`` 128/2/4 (0.4 M parameters: smoke runs and
exactness checks, whose code paths do not depend on the depth), ``nano`` 128/6/4 (1.2 M, for CPU runs),
``tiny`` 192/12/3, ``small`` 384/12/6, ``base`` 768/12/12, ``large`` 1024/24/16 (DeiT / ViT).
Backbone names (`VIT_BACKBONES`): ``vit_<size>`` has 16 px patches on 224 px images;
``vit_<size>_p8`` 8 px patches on 64 px images; ``vit_<size>_p4`` 4 px patches on 32 px images
(CIFAR: 8 x 8 patches); ``vit_<size>_p2`` 2 px patches on 16 px images (the embedded digits: 8 x 8
patches). ``vit_<size>_auto`` (`VIT_AUTO`, the recipes' default) takes its patch size from the image
size (`auto_patch_size`: 2 px at 16 px, 4 at 32, 8 at 64, 16 at 128 and above) and is pinned to one
of the names above for a run (`pin_vit`), as a ResNet's stem is.

Example::

    vit = build_vit("vit_tiny_p4")                   # 32 px images, 64 patches of 4 x 4
    feats = vit(images)                              # [B, 192] class token
    tokens = vit.forward_tokens(images, keep=idx)    # [B, 1 + idx.shape[1], 192]
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.config.fields import count
from unison.errors import ConfigError

VIT_SIZES: dict[str, tuple[int, int, int]] = {    # embed_dim, depth, num_heads
    "micro": (128, 2, 4),
    "nano": (128, 6, 4),
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
}
_PATCHES = {"": (16, 224), "_p8": (8, 64), "_p4": (4, 32), "_p2": (2, 16)}   # name suffix -> (patch, image size)
VIT_BACKBONES: tuple[str, ...] = tuple(f"vit_{size}{suffix}" for size in VIT_SIZES for suffix in _PATCHES)
VIT_AUTO: tuple[str, ...] = tuple(f"vit_{size}_auto" for size in VIT_SIZES)
# `auto_patch_size`: at least this many patches per side (masking, multi-crop and I-JEPA's blocks need a grid;
# 8 x 8 is what the CIFAR and digits recipes were tuned on), with the largest patch that leaves them.
AUTO_MIN_GRID = 8
AUTO_NO_SIZE = 32   # the image size an unpinned name is read at when none is known (CIFAR, as a ResNet's stem)


class ViT(nn.Module):
    """A timm Vision Transformer with token-level access; see the module docstring."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, embed_dim: int = 192, depth: int = 12,
                 num_heads: int = 3, mlp_ratio: float = 4.0, pool: str = "cls"):
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        if pool not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' or 'mean', got {pool!r}")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        vit = VisionTransformer(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
                                num_heads=num_heads, mlp_ratio=mlp_ratio, num_classes=0, global_pool="token")
        assert vit.cls_token is not None and vit.pos_embed is not None
        self.patch_embed = vit.patch_embed
        self.cls_token: nn.Parameter = vit.cls_token
        self.pos_embed: nn.Parameter = vit.pos_embed        # [1, 1 + grid * grid, D], class position first
        self.blocks = nn.ModuleList(vit.blocks)
        self.norm = vit.norm
        self.patch_size, self.embed_dim, self.pool = patch_size, embed_dim, pool
        self.grid = img_size // patch_size
        self.feature_dim = embed_dim

    def num_patches(self, image_size: int) -> int:
        return self.grid_size(image_size) ** 2

    def grid_size(self, image_size: int) -> int:
        if image_size % self.patch_size:   # a ConfigError: one line, also when a worker finds it
            raise ConfigError(f"image size {image_size} is not a multiple of the patch size {self.patch_size} of the ViT; "
                              f"give --image-size a multiple of {self.patch_size}")
        return image_size // self.patch_size

    def _pos_embed(self, grid: int) -> torch.Tensor:
        """[1, 1 + grid * grid, D]: the positional embedding, patch part resampled bicubically (antialiased) to
        `grid` as timm's ``resample_abs_pos_embed``, but in the parameter's own precision (timm's computes in
        float32, which would cost a float64 exactness check its digits)."""
        if grid == self.grid:
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        work = torch.float32 if patch_pos.dtype in (torch.float16, torch.bfloat16) else patch_pos.dtype
        img = patch_pos.to(work).reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
        img = F.interpolate(img, size=(grid, grid), mode="bicubic", antialias=True)
        return torch.cat([cls_pos, img.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(patch_pos.dtype)], dim=1)

    def patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Patch embeddings plus positional embedding, [B, N, D] (no class token)."""
        if x.shape[-1] != x.shape[-2]:
            raise ValueError(f"ViT expects square images, got {tuple(x.shape[-2:])}")
        grid = self.grid_size(x.shape[-1])
        t = self.patch_embed.proj(x).flatten(2).transpose(1, 2)      # [B, N, D], row-major patches
        t = self.patch_embed.norm(t)
        return t + self._pos_embed(grid)[:, 1:]

    def forward_tokens(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       mask_token: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised output tokens [B, 1 + n, D] (class token first) of the patches `keep` (default all);
        patches where `mask` is True are replaced by `mask_token` (plus their positional embedding); `attn_mask`
        (boolean, [B, 1, 1 + n, 1 + n], True where a token may attend) restricts every block's attention.

        Goes through ``self(...)`` so that wrappers hooked on the forward (FSDP2's parameter gathering under
        ``--shard full``) run for token access too."""
        return self(x, tokens=True, keep=keep, mask=mask, mask_token=mask_token, attn_mask=attn_mask)

    def _tokens(self, x: torch.Tensor, keep: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                mask_token: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """See `forward_tokens`."""
        t = self.patch_tokens(x)
        if mask is not None:
            if mask_token is None:
                raise ValueError("forward_tokens: a mask needs a mask_token")
            grid = self.grid_size(x.shape[-1])
            filler = mask_token.to(t.dtype) + self._pos_embed(grid)[:, 1:]
            t = torch.where(mask.unsqueeze(-1), filler, t)
        if keep is not None:
            t = t.gather(1, keep.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(t.shape[0], -1, -1)
        t = torch.cat([cls, t], dim=1)
        if attn_mask is None:
            for block in self.blocks:
                t = block(t)
        else:
            bias = additive_mask(attn_mask, t)
            for block in self.blocks:
                t = block(t, attn_mask=bias)
        return self.norm(t)

    def forward(self, x: torch.Tensor, *, tokens: bool = False, keep: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled feature [B, D] (class token or patch mean); with ``tokens=True`` every output token."""
        t = self._tokens(x, keep, mask, mask_token, attn_mask)
        if tokens:
            return t
        return t[:, 0] if self.pool == "cls" else t[:, 1:].mean(dim=1)


def additive_mask(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as the additive bias timm's attention takes in both of its
    paths (fused ``scaled_dot_product_attention`` and the explicit softmax): 0 where allowed, -inf elsewhere, in the
    tokens' dtype. Every query must be allowed at least one key (its own), or its softmax is undefined."""
    if allowed.dtype != torch.bool or allowed.dim() != 4 or allowed.shape[-1] != like.shape[1] \
            or allowed.shape[-2] != like.shape[1]:
        raise ValueError(f"attn_mask must be boolean [B, 1, {like.shape[1]}, {like.shape[1]}], got "
                         f"{allowed.dtype} {tuple(allowed.shape)}")
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))


def auto_patch_size(image_size: int) -> int:
    """The patch size of ``vit_<size>_auto`` at `image_size`: the largest of 16, 8, 4 and 2 px that divides it and
    leaves at least `AUTO_MIN_GRID` patches per side (16 px at 224: 14 x 14), else the smallest that divides it.
    An odd size, which no patch divides, is a one-line `ConfigError`."""
    patches = sorted({p for p, _ in _PATCHES.values()}, reverse=True)
    dividing = [p for p in patches if image_size % p == 0]
    if not dividing:
        raise ConfigError(f"image size {image_size} px is not a multiple of any ViT patch size "
                          f"({', '.join(map(str, patches))}); give an even --image-size (e.g. {image_size + 1})")
    return next((p for p in dividing if image_size // p >= AUTO_MIN_GRID), dividing[-1])


def pin_vit(name: str, image_size: int | None) -> str:
    """The ViT of `VIT_BACKBONES` that ``vit_<size>_auto`` is at `image_size` (`auto_patch_size`; without a size,
    `AUTO_NO_SIZE`); any other name as it is."""
    if name not in VIT_AUTO:
        return name
    patch = auto_patch_size(image_size or AUTO_NO_SIZE)
    suffix = next(s for s, (p, _) in _PATCHES.items() if p == patch)
    return name[: -len("_auto")] + suffix


def coarse_grid(backbone: str, patch: int | None, image_size: int) -> str | None:
    """Why `backbone` (as the user named it) is a poor fit at `image_size`, or None: its `patch` px patches leave
    fewer than `AUTO_MIN_GRID` per side, the grid the recipes were set for (masking, multi-crop, I-JEPA's blocks;
    ``vit_tiny`` at 32 px: 2 x 2, four tokens), with the backbone or patch size that gives them. A warning, not a
    refusal: the name was chosen, and it trains."""
    if not patch or image_size // patch >= AUTO_MIN_GRID:
        return None
    grid = image_size // patch
    auto = auto_patch_size(image_size) if image_size % 2 == 0 else None
    fix = "a larger --image-size"
    if auto is not None and image_size // auto > grid:   # a smaller patch gives a finer grid at this size
        finer = f"{image_size // auto} x {image_size // auto}"
        if backbone.startswith("timm:"):
            fix = f"--backbone-arg patch_size={auto} ({finer}) or {fix}"
        elif backbone in VIT_BACKBONES:
            named = f"vit_{backbone[len('vit_'):].partition('_')[0]}_auto"
            fix = f"--backbone {named} ({pin_vit(named, image_size)} at {image_size} px: {finer}) or {fix}"
    tokens = count(grid * grid, "token")
    return (f"--backbone {backbone} at {image_size} px: its {patch} px patches make a {grid} x {grid} grid ({tokens}), "
            f"below the {AUTO_MIN_GRID} x {AUTO_MIN_GRID} the recipes are set for; give {fix}")


def vit_patch_size(name: str) -> int:
    """The patch size of ViT `name` of `VIT_BACKBONES` (16, or 8 for ``_p8``, 4 for ``_p4``, 2 for ``_p2``)."""
    suffix = name[len("vit_"):].partition("_")[2]
    return _PATCHES["_" + suffix if suffix else ""][0]


def vit_timm_kwargs(name: str) -> dict[str, int]:
    """The arguments of timm's ``VisionTransformer`` that take the state dict of ViT `name` (`build_vit`'s): its
    parameter names are timm's, and timm's class-token forward gives the same feature."""
    size, _, suffix = name[len("vit_"):].partition("_")
    patch, img = _PATCHES["_" + suffix if suffix else ""]
    dim, depth, heads = VIT_SIZES[size]
    return {"img_size": img, "patch_size": patch, "embed_dim": dim, "depth": depth, "num_heads": heads,
            "num_classes": 0}


def build_vit(name: str) -> ViT:
    """A `ViT` from a name of `VIT_BACKBONES` (``vit_tiny``, ``vit_nano_p2``, ...)."""
    if name not in VIT_BACKBONES:
        raise ValueError(f"unknown ViT {name!r}; use one of {', '.join(VIT_BACKBONES)}")
    kw = vit_timm_kwargs(name)
    return ViT(img_size=kw["img_size"], patch_size=kw["patch_size"], embed_dim=kw["embed_dim"], depth=kw["depth"],
               num_heads=kw["num_heads"])
