"""DINOv3 (Siméoni et al., 2025): DINOv2 with Gram anchoring in the last part of training, and DINOv3's recipe.

    loss = L_DINOv2 + w(step) * L_Gram(student patch tokens, Gram teacher patch tokens)
           L_DINOv2: `unison.methods.dinov2` (DINO + iBOT with separate heads + KoLeo, Sinkhorn-Knopp)
           L_Gram:   `unison.losses.GramAnchoringLoss`: per image, the mean squared difference of the
                     Gram matrices of L2-normalised patch features: the student's (output tokens of its
                     masked global crops) and the Gram teacher's (the unmasked global crops)
           w(step) = 2 from the start step s_0 = floor(5/6 * steps_total), else 0
    Gram teacher g: a snapshot of the EMA teacher's backbone, no gradient, loaded before step s_0 and
                    refreshed before steps s_0 + k P, k = 1..3, P = max(1, round(steps_total / 120))
    f', h' <- m f', h' + (1 - m) f, h,   m = 0.994 (constant)
    tau_t: linear warm-up 0.04 -> 0.07 over the first 10 % of the steps, then 0.07

The schedule is DINOv3's Gram anchoring of its ViT-7B (``dinov3_vit7b16_gram_anchor.yaml``: Gram weight
``loss_weight_schedule`` 0 -> 2.0 from iteration 1,000,000 of 1,200,000; the Gram teacher loaded from the EMA
teacher there, refreshed every ``update_frequency`` 10,000 iterations from ``it_first_update`` 1,010,000,
``max_updates`` 3), as fractions of unison's run: start ``gram_start_fraction`` 5/6, refresh period
``gram_refresh_fraction`` 1/120, ``gram_refreshes`` 3, ``gram_weight`` 2. The start is rounded down, so a run of
a handful of steps (``unison check``'s) anchors its last steps; the official weight rises from 0 to 2 by a cosine
over 1000 iterations (1/1200 of the run), taken here as a step.

DINOv3's other changes taken: separate DINO and iBOT heads (``ibot.separate_head: true``, both of the DINO head's
shape here; the ViT-7B's are 8192 / 512 / 262144 and 4096 / 384 / 98304, reduced for CPU), Sinkhorn-Knopp,
constant schedules where a method owns them (teacher momentum 0.994, the ViT-7B's ``schedules.momentum``;
weight decay 0.04, which unison keeps constant for every method), the teacher temperature's warm-up over 100 of
1000 epochs. Not taken: the constant learning rate after warm-up (unison's is a cosine for every method:
``--final-lr-ratio`` brings its end close to the peak), the Gram teacher's crops at twice the resolution with
no colour distortions and its features resized to the student's grid (here it sees the student's global crops
as they are), RoPE, register tokens, LayerScale and untied norms of the ViT, the DINO local-crop loss
reweighting of the anchoring phase, and the ViT-7B's AdamW beta2 0.99 and layer-wise decay 0.98. Everything
else is `unison.methods.dinov2`'s (masks, KoLeo, augmentations, optimizer).

Distributed semantics: DINOv2's, plus the Gram term, a mean over local images (nothing gathered). The Gram
teacher is rank-local state like the EMA teacher it copies: every rank holds the same copy (made on every rank
from the same EMA teacher, at the same steps; under ``--shard full`` each rank copies its own shards, which the
two teachers share), never broadcast by DDP after the first forward, and saved in checkpoints with the count of
loads made (``gram_loads``), so a resumed run anchors to the same snapshot and refreshes it at the same steps.
Exact with gather on, at every step, accumulation included.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = DINOv3(backbone, dim, DINOv3Params(), steps_total=10_000)
    loss = model([global_a, global_b, *local_crops], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.losses.gram import GramAnchoringLoss

from ._common import require_vit
from .base import SampleKeys
from .dinov2 import DINOv2, DINOv2Params
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class DINOv3Params(DINOv2Params):
    separate_head: bool = True           # ibot.separate_head (every DINOv3 config)
    momentum_base: float = 0.994         # schedules.momentum of the ViT-7B: constant
    teacher_temp_warmup_fraction: float = 0.1   # schedules.teacher_temp: 100 of 1000 epochs
    gram_weight: float = 2.0             # the anchoring phase's loss_weight_schedule end
    gram_start_fraction: float = 5 / 6   # iteration 1,000,000 of 1,200,000
    gram_refresh_fraction: float = 1 / 120   # update_frequency 10,000 of 1,200,000 iterations
    gram_refreshes: int = 3              # max_updates

    def __post_init__(self) -> None:
        check_params(self, non_negative=("gram_weight",), counts=("gram_refreshes",),
                     unit_interval=("gram_start_fraction", "gram_refresh_fraction"))
        super().__post_init__()

    def terms(self) -> dict[str, bool]:
        return {**super().terms(), "gram_weight (with gram_start_fraction < 1)":
                self.gram_weight > 0 and self.gram_start_fraction < 1}


class DINOv3(DINOv2):
    name = "dinov3"
    label = "DINOv3"
    Params = DINOv3Params
    gram_loads: torch.Tensor   # buffer: how many times the Gram teacher was loaded (rank-local, checkpointed)

    def __init__(self, backbone: nn.Module, feature_dim: int, params: DINOv3Params, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.gram_teacher = MomentumTeacher(backbone=self.backbone)   # loaded from the EMA teacher on schedule
        self.register_buffer("gram_loads", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["gram_loads"])
        self.gram_loss = GramAnchoringLoss()

    def momentum(self, step: float) -> float:
        """DINOv3's constant teacher momentum."""
        return self.params.momentum_base

    def gram_start(self) -> int:
        """The first step the Gram term counts at (floor of ``gram_start_fraction`` of the run)."""
        return math.floor(self.params.gram_start_fraction * self.steps_total)

    def gram_loads_due(self, step: int) -> int:
        """How many loads of the Gram teacher the schedule has made by the forward of optimiser step `step`:
        0 before the start, then 1 + the refreshes since, at most ``gram_refreshes``."""
        p, start = self.params, self.gram_start()
        position = self.schedule_step(step)
        if position < start:
            return 0
        period = max(1, round(p.gram_refresh_fraction * self.steps_total))
        return 1 + min(p.gram_refreshes, math.floor((position - start) / period))

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        step, loads = (int(v) for v in torch.stack([self.step_count, self.gram_loads]).tolist())
        due = self.gram_loads_due(step)
        if due > loads:   # the EMA teacher as it stands after the last step (every rank, the same step)
            self.teacher.sync_once()   # rank 0's on the first forward: then every rank's snapshot is the same
            self.gram_teacher.load_from(self.teacher)
            self.gram_loads.fill_(due)
        out = self.distill(views, keys, step)
        if due == 0 or self.params.gram_weight == 0:
            return out.loss
        with torch.no_grad():
            anchor = require_vit(self.gram_teacher.backbone, self.label).forward_tokens(out.global_crops)[:, 1:]
        return out.loss + self.params.gram_weight * self.gram_loss(out.student_tokens[:, 1:], anchor)
