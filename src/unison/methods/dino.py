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

Example::

    backbone, dim = build_backbone("resnet18")
    model = DINO(backbone, dim, DINOParams(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops]); ...; model.on_after_step(step)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.tagging import mark_rank_local_state
from unison.losses import DINOLoss

from ._common import check_multicrop, cosine_momentum, multicrop_features
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


class DINOHead(nn.Module):
    """MLP -> L2-normalised bottleneck -> weight-normalised linear layer (unit-norm rows, no bias)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 num_layers: int = 3, batch_norm: bool = False):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"the DINO head needs at least 1 layer, got {num_layers}")
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))   # a bias before BN is a no-op
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            dim = hidden_dim
        layers.append(nn.Linear(dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        for m in self.mlp.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.last_layer = nn.Linear(bottleneck_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1)
        return F.linear(x, F.normalize(self.last_layer.weight, dim=1))


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
        check_params(self, sizes=("hidden_dim", "bottleneck_dim", "out_dim", "head_layers"),
                     positive=("student_temp", "teacher_temp", "warmup_teacher_temp"),
                     unit_interval=("momentum_base", "teacher_temp_warmup_fraction", "center_momentum"))


class DINO(SSLMethod):
    name = "dino"
    Params = DINOParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="multicrop")

    step_count: torch.Tensor   # buffer: optimiser steps taken

    def __init__(self, backbone: nn.Module, feature_dim: int, params: DINOParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.head = DINOHead(feature_dim, params.out_dim, params.hidden_dim, params.bottleneck_dim,
                             params.head_layers, params.head_batch_norm)
        self.teacher = MomentumTeacher(backbone=self.backbone, head=self.head)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = DINOLoss(params.out_dim, params.student_temp, params.center_momentum,
                                gather_distributed=self.gather_distributed)

    def momentum(self, step: int) -> float:
        return cosine_momentum(self.params.momentum_base, step, self.steps_total)

    def teacher_temp(self, step: int) -> float:
        p = self.params
        warmup = round(p.teacher_temp_warmup_fraction * self.steps_total)
        if warmup <= 0 or step >= warmup:
            return p.teacher_temp
        return p.warmup_teacher_temp + (p.teacher_temp - p.warmup_teacher_temp) * step / warmup

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        n = check_multicrop(views, "DINO")
        self.teacher.sync_once()
        with torch.no_grad():
            teacher = self.teacher.head(self.teacher.backbone(torch.cat(views[:2]))).split(n)
        student = self.head(multicrop_features(self.backbone, views)).split(n)
        return self.loss_fn(list(student), list(teacher), self.teacher_temp(int(self.step_count)))

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.teacher.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: each rank centres the teacher with its local batch mean"
        return None
