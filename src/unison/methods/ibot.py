"""iBOT / DINOv2-style (Zhou et al., 2022; Oquab et al., 2024): DINO on class tokens, masked-patch distillation, KoLeo.

    masks:    per sample and global crop, m = round(mask_ratio * N) random patches (`random_masking`)
    student:  ViT f on the global crops with the masked patches replaced by a learned mask
              token, and on the local crops; DINO head h on the class tokens and on the
              output patch tokens at the masked positions
    teacher:  f', h' (EMA of f, h, no gradient) on the unmasked global crops
    loss   =  cls_weight * L_cls + patch_weight * L_patch + koleo_weight * sum_i KoLeo(f(global crop i) class token)
              L_cls, L_patch: `unison.losses.IBOTLoss` (centring as iBOT, or Sinkhorn-Knopp as DINOv2)
    f', h' <- m f', h' + (1 - m) f, h,  m = 1 - (1 - 0.996) (cos(pi step / steps_total) + 1) / 2
    tau_t: linear warm-up 0.04 -> 0.07 over the first ``teacher_temp_warmup_fraction`` of the steps

Masks: a fixed number of random patches per crop (iBOT's "rand" shape with a fixed ratio;
its default block-shaped masks with a ratio drawn per image give every image a different
count: `unison.methods.dinov2` pads such masks to one width, with weights). The head is
shared between class and patch tokens (the default of DINOv2's ``ssl_default_config.yaml``).

Defaults: iBOT's ViT head (3 layers, no batch norm, GELU, bottleneck 256) with width 512 and
1024 prototypes (official: 2048 / 8192 for iBOT, 65536 for DINOv2; reduced for CPU), mask
ratio 0.3, teacher momentum 0.996, temperatures 0.04 -> 0.07 / 0.1, centre momentum 0.9,
loss weights 1 / 1 and KoLeo 0.1 (DINOv2); AdamW, lr 5e-4 per 256 images, weight decay 0.04
(official; the weight-decay schedule, last-layer freezing and layer-wise decay are not
implemented); multi-crop augmentations.

Distributed semantics: masks depend on (seed, epoch, sample index, crop) only; centres and
Sinkhorn use the global batch (`unison.losses.ibot`); KoLeo searches each feature's nearest
neighbour in the GLOBAL batch through `all_gather_with_grad` (`unison.losses.koleo`; DINOv2
searches per GPU); every term is a mean over local samples. Exact with gather on. Teacher,
centres and the step counter are rank-local state (never broadcast by DDP, saved in
checkpoints); rank 0's teacher is copied to every rank on the first forward.

Head, teacher, step counter and both schedules live in `unison.methods.distillation` (shared with DINO).
`unison.methods.dinov2.DINOv2` is this method with DINOv2's masks and recipe: it overrides `IBOT.patch_masks`
(the masks as a `PatchMasks`), and `IBOT.distill` gives DINOv3 the tokens its Gram anchoring reads.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = IBOT(backbone, dim, IBOTParams(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.losses import IBOTLoss, KoLeoLoss
from unison.losses.ibot import CENTERINGS

from ._common import check_multicrop, multicrop_features, require_vit
from .base import Recipe, SampleKeys
from .distillation import DistillationParams, SelfDistillation
from .masking import random_masking
from .params import check_params, check_trains

MASK_STREAM = 0x1B07_0000     # + global crop index: counter-based RNG stream of iBOT's masks


@dataclass
class IBOTParams:
    hidden_dim: int = 512                # official: 2048 (reduced for CPU)
    bottleneck_dim: int = 256
    out_dim: int = 1024                  # official: 8192 (iBOT), 65536 (DINOv2)
    head_layers: int = 3
    head_batch_norm: bool = False        # official ViT heads: no batch norm
    mask_ratio: float = 0.3              # iBOT pred_ratio
    momentum_base: float = 0.996
    student_temp: float = 0.1
    teacher_temp: float = 0.07
    warmup_teacher_temp: float = 0.04
    teacher_temp_warmup_fraction: float = 0.1
    center_momentum: float = 0.9
    centering: str = "centre"            # "centre" (iBOT) or "sinkhorn" (DINOv2)
    cls_weight: float = 1.0
    patch_weight: float = 1.0
    koleo_weight: float = 0.1            # DINOv2 (iBOT: no KoLeo, 0)

    def __post_init__(self) -> None:
        check_params(self, sizes=("hidden_dim", "bottleneck_dim", "head_layers"), classes=("out_dim",),
                     temperatures=("student_temp", "teacher_temp", "warmup_teacher_temp"),
                     non_negative=("cls_weight", "patch_weight", "koleo_weight"),
                     unit_interval=("mask_ratio", "momentum_base", "teacher_temp_warmup_fraction", "center_momentum"))
        if self.centering not in CENTERINGS:
            raise ConfigError(f"IBOT parameter centering={self.centering!r} must be one of {', '.join(CENTERINGS)} "
                              "(--param centering=VALUE)")
        if self.centering == "sinkhorn":   # the teacher temperatures are Sinkhorn's epsilon
            check_params(self, sinkhorn=("teacher_temp", "warmup_teacher_temp"))
        check_trains(self, {"cls_weight": self.cls_weight > 0, "patch_weight (with mask_ratio > 0)":
                            self.patch_weight > 0 and self.mask_ratio > 0, "koleo_weight": self.koleo_weight > 0})


@dataclass
class PatchMasks:
    """The masks of a step's 2 global crops (crop-major: crop 0's n samples, then crop 1's)."""

    is_masked: torch.Tensor              # bool [2n, N]: where the student sees the mask token
    at: torch.Tensor                     # long [2n, m]: the masked patches the patch loss reads
    weights: torch.Tensor | None = None  # [2n, m]: 1 / the crop's count, 0 at padding; None: every crop masks m


@dataclass
class Distilled:
    """What `IBOT.distill` computed: the loss, the step its schedules read, and what DINOv3 adds a term on."""

    loss: torch.Tensor
    step: int
    student_tokens: torch.Tensor         # [2n, 1 + N, D]: the student's output tokens of the masked global crops
    global_crops: torch.Tensor           # [2n, C, H, W]: the 2 global crops, concatenated


class IBOTLikeParams(DistillationParams, Protocol):
    """What `IBOT` reads of its parameters besides the head's and the schedules': `IBOTParams`, and DINOv2's."""

    student_temp: float
    center_momentum: float
    centering: str
    cls_weight: float
    patch_weight: float
    koleo_weight: float


class IBOT(SelfDistillation):
    name = "ibot"
    label = "iBOT"                       # the method as messages name it
    Params: ClassVar[type] = IBOTParams   # DINOv2 and DINOv3 give their own
    needs_sample_keys = True
    recipe = Recipe(optimizer="adamw", base_lr=5e-4, weight_decay=0.04, augmentation="multicrop",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 1e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: IBOTLikeParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        require_vit(backbone, self.label)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, feature_dim))
        # head, teacher, step counter (`unison.methods.distillation`); DINOv2 may give patches their own head
        self.build_distillation(params, patch_head=getattr(params, "separate_head", False))
        self.loss_fn = IBOTLoss(params.out_dim, params.student_temp, params.center_momentum, params.centering,
                                gather_distributed=self.gather_distributed)
        self.koleo = KoLeoLoss(gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        return self.distill(views, keys, int(self.step_count)).loss

    def patch_masks(self, keys: SampleKeys, grid: int, device: torch.device) -> PatchMasks:
        """The student's masks of the 2 global crops: m = round(mask_ratio * N) random patches each."""
        n_patches = grid * grid
        n_masked = round(self.params.mask_ratio * n_patches)
        if not 1 <= n_masked <= n_patches:
            raise ConfigError(f"iBOT mask_ratio={self.params.mask_ratio} masks {n_masked} of {n_patches} patches; mask "
                              "at least one (--param mask_ratio=VALUE)")
        masked = torch.cat([random_masking(keys, MASK_STREAM + i, n_patches, n_masked, device)[1]
                            for i in range(2)])                                        # [2n, m]
        is_masked = torch.zeros(masked.shape[0], n_patches, dtype=torch.bool,
                                device=masked.device).scatter_(1, masked, True)
        return PatchMasks(is_masked, masked)

    def distill(self, views: list[torch.Tensor], keys: SampleKeys | None, step: int) -> Distilled:
        """The loss of the module docstring at optimiser step `step` (its teacher temperature)."""
        if keys is None:
            raise ValueError(f"{self.label} draws its masks per sample: call it with "
                             "keys=SampleKeys(seed, epoch, indices)")
        n = check_multicrop(views, self.label)
        p = self.params
        vit, teacher_vit = require_vit(self.backbone, self.label), require_vit(self.teacher.backbone, self.label)
        masks = self.patch_masks(keys, vit.grid_size(views[0].shape[-1]), views[0].device)
        m = masks.at.shape[1]
        at_masked = masks.at.unsqueeze(-1).expand(-1, -1, self.feature_dim)
        separate = hasattr(self, "ibot_head")
        patch_head = self.ibot_head if separate else self.head
        teacher_patch_head = self.teacher.ibot_head if separate else self.teacher.head

        self.teacher.sync_once()
        globals_ = torch.cat(views[:2])
        with torch.no_grad():
            t = teacher_vit.forward_tokens(globals_)
            t_cls = self.teacher.head(t[:, 0]).split(n)
            t_patch = teacher_patch_head(t[:, 1:].gather(1, at_masked).flatten(0, 1)).view(2 * n, m, -1)
        s = vit.forward_tokens(globals_, mask=masks.is_masked, mask_token=self.mask_token)
        s_global_cls = s[:, 0]
        s_cls = [s_global_cls] + ([multicrop_features(self.backbone, views[2:])] if len(views) > 2 else [])
        s_cls_out = self.head(torch.cat(s_cls)).split(n)
        s_patch = patch_head(s[:, 1:].gather(1, at_masked).flatten(0, 1)).view(2 * n, m, -1)

        weights = None if masks.weights is None else \
            list(masks.weights.to(torch.promote_types(s.dtype, torch.float32)).split(n))
        loss_cls, loss_patch = self.loss_fn(list(s_cls_out), list(t_cls), list(s_patch.split(n)),
                                            list(t_patch.split(n)), self.teacher_temp(step), patch_weights=weights)
        loss = p.cls_weight * loss_cls + p.patch_weight * loss_patch
        if p.koleo_weight > 0:
            loss = loss + p.koleo_weight * sum(self.koleo(c) for c in s_global_cls.split(n))
        return Distilled(loss, step, s, globals_)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: centres, Sinkhorn and KoLeo's neighbours use each rank's local batch"
        return None
