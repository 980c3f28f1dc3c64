"""DINO (Caron et al., 2021): self-distillation from a momentum teacher with centring and sharpening.

    student: s = h(f(x)) for every crop       backbone f (one pass per crop resolution), DINO head h
    teacher: t = h'(f'(x)) for global crops   EMA of (f, h), no gradient
    loss = DINOLoss(s, t; centre c, tau_t(step), tau_s = 0.1)   cross-entropy over (teacher, student) crop pairs
    f', h' <- m f', h' + (1 - m) f, h,  m = 1 - (1 - 0.996) (cos(pi step / steps_total) + 1) / 2
    tau_t: linear warm-up 0.04 -> 0.07 over the first ``teacher_temp_warmup_fraction`` of the steps

DINO head (official): MLP (Linear [+ BN] + GELU layers; no Linear bias before a BN, which
would cancel it) to a bottleneck, L2 normalisation,
then a weight-normalised linear layer without bias whose norm is fixed to 1
(``norm_last_layer=True``): its rows are normalised in the forward pass.

Defaults: Lightly's CIFAR-10 benchmark head (2 layers, batch norm, bottleneck 256) with the
hidden width reduced from 2048 to 512 and the output from 2048 to 1024 for CPU, official
DINO schedules (teacher momentum 0.996 -> 1, teacher temperature 0.04 -> 0.07, student 0.1,
centre momentum 0.9), Lightly's SGD recipe (lr 0.12 per 256 images, weight decay 5e-4),
multi-crop augmentations (2 global + local crops; the teacher sees only the global ones).
Not implemented: freezing the last layer during the first epoch, gradient clipping (use
the trainer's ``grad_clip``), the weight-decay schedule.

Distributed semantics: the loss is a mean over local samples and crop pairs; the centre
is updated after the loss with the *old* centre, from the all-reduced teacher mean over the
global batch, identically on every rank (see `unison.losses.dino`). Exact with gather on
and SyncBN. Teacher (a `MomentumTeacher`), centre and step counter are rank-local state (never broadcast
by DDP, saved in checkpoints); rank 0's teacher is copied to every rank once, on the first
forward (the centre starts at zero on every rank).

Head, teacher, step counter and both schedules live in `unison.methods.distillation` (shared with iBOT).

Example::

    backbone, dim = build_backbone("resnet18")
    model = DINO(backbone, dim, DINOParams(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops]); ...; model.on_after_step(step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.losses import DINOLoss

from ._common import TWO_VIEWS_UP_TO_PX, check_multicrop, multicrop_features
from .base import Recipe
from .distillation import DINOHead, SelfDistillation
from .params import check_params

__all__ = ["DINO", "DINOHead", "DINOParams"]


@dataclass
class DINOParams:
    hidden_dim: int = 512               # Lightly CIFAR-10: 2048 (reduced for CPU)
    bottleneck_dim: int = 256
    out_dim: int = 1024                 # Lightly CIFAR-10: 2048, official: 65536 (reduced for CPU)
    head_layers: int = 2                # Lightly CIFAR-10: 2, official: 3
    head_batch_norm: bool = True        # Lightly CIFAR-10 (official ViT heads: False)
    momentum_base: float = 0.996
    student_temp: float = 0.1
    teacher_temp: float = 0.07
    warmup_teacher_temp: float = 0.04
    teacher_temp_warmup_fraction: float = 0.1   # share of steps_total (official: 30 of 100-300 epochs)
    center_momentum: float = 0.9

    def __post_init__(self) -> None:
        check_params(self, sizes=("hidden_dim", "bottleneck_dim", "head_layers"), classes=("out_dim",),
                     temperatures=("student_temp", "teacher_temp", "warmup_teacher_temp"),
                     unit_interval=("momentum_base", "teacher_temp_warmup_fraction", "center_momentum"))


class DINO(SelfDistillation):
    name = "dino"
    Params = DINOParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="multicrop",
                    global_views_up_to=TWO_VIEWS_UP_TO_PX)

    def __init__(self, backbone: nn.Module, feature_dim: int, params: DINOParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.build_distillation(params)   # head, teacher, step counter (`unison.methods.distillation`)
        self.loss_fn = DINOLoss(params.out_dim, params.student_temp, params.center_momentum,
                                gather_distributed=self.gather_distributed)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        n = check_multicrop(views, "DINO")
        self.teacher.sync_once()
        with torch.no_grad():
            teacher = self.teacher.head(self.teacher.backbone(torch.cat(views[:2]))).split(n)
        student = self.head(multicrop_features(self.backbone, views)).split(n)
        return self.loss_fn(list(student), list(teacher), self.teacher_temp(int(self.step_count)))

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: each rank centres the teacher with its local batch mean"
        return None
