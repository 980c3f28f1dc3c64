"""DINOv2 (Oquab et al., 2024): iBOT's self-distillation with DINOv2's masks, Sinkhorn-Knopp teacher, KoLeo and recipe.

    masks:    per global crop of each sample, with probability 1/2 a block mask of floor(N r) patches,
              r uniform in [0.1, 0.5] (`unison.methods.masking.dinov2_masking`), else none
    student:  ViT f on the global crops with the masked patches replaced by a learned mask token, and
              on the local crops; DINO head h on the class tokens, iBOT head h_p (= h by default) on
              the output patch tokens at the masked positions
    teacher:  f', h', h_p' (EMA of f, h, h_p, no gradient) on the unmasked global crops
    loss   =  L_cls + L_patch + 0.1 * sum_i KoLeo(f(global crop i) class token)
              L_cls:   mean over (teacher crop i, student crop v != i) of the cross-entropy to P_t(h'(f'))
              L_patch: mean over global crops of (1/n) sum_b (1/m_b) sum_{j masked} cross-entropy at j
                       (a crop without a mask adds 0 and still counts: DINOv2's ``forward_masked``)
              P_t: Sinkhorn-Knopp, epsilon = tau_t, 3 iterations, over the global batch's class
                   tokens, and separately over its masked patch tokens (`unison.losses.IBOTLoss`)
    f', h' <- m f', h' + (1 - m) f, h,  m = 1 - (1 - 0.992) (cos(pi step / steps_total) + 1) / 2
    tau_t: linear warm-up 0.04 -> 0.07 over the first 30 % of the steps, then 0.07

It is `unison.methods.ibot.IBOT` with DINOv2's masks (`DINOv2.patch_masks`), the patch head shared or
separate (``separate_head``) and DINOv2's parameters and recipe; `unison.methods.dinov3` adds Gram anchoring.

Masks: each crop's count m_b differs, so the masked patches are listed at one width, floor(N * 0.5) (the most
a crop masks), with weight 1 / m_b, and 0 at the padding (`unison.methods.masking.padded_masked`): the
shapes are the batch's whatever the masks are, and the padding takes no part in the loss or in Sinkhorn. What
differs from the official collator (``collate_data_and_cast``) and why: it masks exactly int(B / 2) of the B
global crops of each GPU's batch, their ratios stratified over [0.1, 0.5] (one per sub-interval of
``linspace(0.1, 0.5, B / 2 + 1)``) and shuffled; that couples the crops of a batch, so a crop's mask would
depend on its batch and the number of GPUs. Here each crop is masked independently, with probability 1/2 and
its ratio uniform in [0.1, 0.5]: the same distribution per crop, drawn from (seed, epoch, sample index, crop)
only. The block generator's tries are bounded (`unison.methods.masking.MAX_MASK_TRIES`; the official loop
stops on its own before that).

Distributed semantics: masks depend on (seed, epoch, sample index, crop) only; Sinkhorn all-reduces its sums and
counts (the masked patches of every rank together, as DINOv2's all-reduced ``n_masked_patches``); KoLeo
searches each class token's nearest neighbour in the GLOBAL batch (`unison.losses.koleo`; DINOv2 searches per
GPU, so its loss depends on the number of GPUs); every term is a mean over local samples. Exact with gather
on. Teacher and step counter are rank-local state (checkpointed); rank 0's teacher is copied to every rank on
the first forward.

Defaults, with the official values (``ssl_default_config.yaml``, the ViT-L/16 ``vitl16_short`` recipe, and
the ViT-L/14 and g/14 configs where they differ): heads of 3 layers, width 512, bottleneck 256, 1024
prototypes (official 2048 / 256 / 65536, and 384 / 131072 for ViT-L/14 and g/14: reduced for CPU), one head
for class and patch tokens (the default's ``ibot.separate_head: false``; the ViT-L/14 and g/14 configs
separate them: ``--param separate_head=true``, a second head of the same shape); loss weights 1 / 1, KoLeo
0.1; mask probability 0.5, ratios 0.1 to 0.5; teacher momentum 0.992 -> 1 (0.994 for ViT-L/14, g/14),
temperatures 0.04 -> 0.07 over 30 of 100 epochs, student 0.1; Sinkhorn-Knopp (the ViT-L/14 and g/14 configs'
``centering: sinkhorn_knopp``; the default's ``centering``: ``--param centering=centre``). AdamW
(0.9, 0.999), weight decay 0.04; the official base lr 0.004 for a batch of 1024 is scaled by sqrt(B / 1024),
unison scales linearly per 256 images: 1e-3 per 256, the official rate at a batch of 1024. Multi-crop: 2
global crops from 32-100 % of the image, 8 local crops from 5-32 % at 3/7 of its side (96 px at 224), DINO's
colour jitter (the ``dinov2`` augmentation preset). Not implemented, and what gives them where unison can:
the weight-decay cosine 0.04 -> 0.4 (0.2 for ViT-L/14, g/14), layer-wise lr decay 0.9 (``--layer-decay
0.9``; 1.0 in the ViT-L/14 and g/14 configs), the patch embedding's lr x 0.2, freezing the last layer for the
first epoch, gradient clipping at 3 (``--grad-clip 3``), stochastic depth and LayerScale, the trainable
weight-norm gain of the prototypes (unit-norm here, as DINO's), and the per-view blur (1.0 / 0.1 / 0.5) and
solarisation (0.2, second global crop) of the augmentations (0.5 and none on every view here).

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = DINOv2(backbone, dim, DINOv2Params(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from unison.errors import ConfigError
from unison.losses.ibot import CENTERINGS

from .base import Recipe, SampleKeys
from .ibot import IBOT, PatchMasks
from .masking import dinov2_masking, padded_masked
from .params import check_params, check_trains

MASK_STREAM = 0xD1_0002_0000     # + global crop index: counter-based RNG stream of DINOv2's masks


@dataclass
class DINOv2Params:
    hidden_dim: int = 512                # official: 2048 (reduced for CPU)
    bottleneck_dim: int = 256            # official: 256 (384 in the ViT-L/14, g/14 configs)
    out_dim: int = 1024                  # official: 65536 (131072 in the ViT-L/14, g/14 configs)
    head_layers: int = 3
    head_batch_norm: bool = False        # official heads: no batch norm
    separate_head: bool = False          # ibot.separate_head of the default config (true for ViT-L/14, g/14)
    mask_probability: float = 0.5        # ibot.mask_sample_probability
    mask_ratio_min: float = 0.1          # ibot.mask_ratio_min_max
    mask_ratio_max: float = 0.5
    momentum_base: float = 0.992         # teacher.momentum_teacher (0.994 for ViT-L/14, g/14), cosine to 1
    student_temp: float = 0.1
    teacher_temp: float = 0.07
    warmup_teacher_temp: float = 0.04
    teacher_temp_warmup_fraction: float = 0.3   # warmup_teacher_temp_epochs 30 of 100
    center_momentum: float = 0.9         # for centering="centre"
    centering: str = "sinkhorn"          # sinkhorn_knopp (ViT-L/14, g/14); "centre": the default config's
    cls_weight: float = 1.0              # dino.loss_weight
    patch_weight: float = 1.0            # ibot.loss_weight
    koleo_weight: float = 0.1            # dino.koleo_loss_weight

    def __post_init__(self) -> None:
        check_params(self, sizes=("hidden_dim", "bottleneck_dim", "head_layers"), classes=("out_dim",),
                     temperatures=("student_temp", "teacher_temp", "warmup_teacher_temp"),
                     non_negative=("cls_weight", "patch_weight", "koleo_weight"),
                     unit_interval=("mask_probability", "mask_ratio_min", "mask_ratio_max", "momentum_base",
                                    "teacher_temp_warmup_fraction", "center_momentum"))
        label = type(self).__name__.removesuffix("Params")
        if not self.mask_ratio_min <= self.mask_ratio_max < 1:
            raise ConfigError(f"{label} parameters mask_ratio_min={self.mask_ratio_min} and mask_ratio_max="
                              f"{self.mask_ratio_max} must satisfy min <= max < 1 (--param mask_ratio_max=VALUE)")
        if self.centering not in CENTERINGS:
            raise ConfigError(f"{label} parameter centering={self.centering!r} must be one of "
                              f"{', '.join(CENTERINGS)} (--param centering=VALUE)")
        if self.centering == "sinkhorn":   # the teacher temperatures are Sinkhorn's epsilon
            check_params(self, sinkhorn=("teacher_temp", "warmup_teacher_temp"))
        self.check_terms()

    def check_terms(self) -> None:
        """`check_trains` over the loss terms (DINOv3 adds its Gram term)."""
        check_trains(self, self.terms())

    def terms(self) -> dict[str, bool]:
        return {"cls_weight": self.cls_weight > 0,
                "patch_weight (with mask_probability and mask_ratio_max > 0)":
                    self.patch_weight > 0 and self.mask_probability > 0 and self.mask_ratio_max > 0,
                "koleo_weight": self.koleo_weight > 0}


def mask_width(params: DINOv2Params, n_patches: int) -> int:
    """The most patches a crop masks: floor(N * mask_ratio_max), the width its masked patches are listed at."""
    return math.floor(n_patches * params.mask_ratio_max)


class DINOv2(IBOT):
    name = "dinov2"
    label = "DINOv2"
    Params = DINOv2Params
    recipe = Recipe(optimizer="adamw", base_lr=1e-3, weight_decay=0.04, augmentation="dinov2",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4"})

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        if patch is None or not view_sizes:
            return
        n_patches = (view_sizes[0] // patch) ** 2
        if params.patch_weight > 0 and params.mask_probability > 0 and mask_width(params, n_patches) < 1:
            raise ConfigError(f"{cls.label} mask_ratio_max={params.mask_ratio_max} masks none of the {n_patches} "
                              f"patches of a {view_sizes[0]} px crop; raise --param mask_ratio_max, or use smaller "
                              "patches")

    def patch_masks(self, keys: SampleKeys, grid: int, device: torch.device) -> PatchMasks:
        """DINOv2's masks of the 2 global crops (module docstring), padded to `mask_width` with weights."""
        p = self.params
        width = max(1, mask_width(p, grid * grid))
        is_masked = dinov2_masking(keys, MASK_STREAM, grid, p.mask_probability, (p.mask_ratio_min, p.mask_ratio_max),
                                   device, crops=2)
        at, weights = padded_masked(is_masked, width)
        return PatchMasks(is_masked, at, weights)
