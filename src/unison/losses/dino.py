"""DINO loss: cross-entropy between a centred, sharpened teacher and the student, over crop pairs.

Teacher outputs t (global crops only, no gradient) and student outputs s (all crops),
each [n, D] per crop, centre c [1, D], temperatures tau_t (teacher, warmed up from 0.04
to 0.07 by the method) and tau_s = 0.1:

    P_t = softmax((t - c) / tau_t),   log P_s = log_softmax(s / tau_s)
    L   = mean over pairs (i teacher crop, v student crop, v != i) of
          (1/n) sum_b -<P_t_i[b], log P_s_v[b]>
    (``same_crop=True``, distillation of a frozen teacher on the student's own views: the pairs (i, i) instead)

After the loss is computed with the *old* centre (as official DINO), the centre moves:

    c <- m * c + (1 - m) * mean of the teacher outputs over the global batch   (m = 0.9)

Distributed semantics: the per-sample terms need nothing from other ranks; each rank
returns the mean over its local samples and pairs, so DDP's gradient average is exactly
the gradient of the global loss, provided the centre is the same everywhere. With
``gather_distributed=True`` the batch mean is ``all_reduce_no_grad`` of [sum of teacher
rows, row count] (one collective of D + 1 numbers), so every rank applies the identical
update and the centres stay bitwise equal. The centre is a persistent buffer (saved in
checkpoints) marked rank-local, so DDP never re-broadcasts it. With
``gather_distributed=False`` each rank centres with its local mean (centres drift apart;
not equivalent to one process). The centre is updated only in training mode.

Example::

    loss_fn = DINOLoss(out_dim=1024)
    loss = loss_fn(student_out_per_crop, teacher_out_per_global_crop, teacher_temp=0.04)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, world_size
from unison.distributed.tagging import mark_rank_local_state


class DINOLoss(nn.Module):
    center: torch.Tensor   # buffer (rank-local running centre of the teacher outputs)

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9,
                 gather_distributed: bool = True, same_crop: bool = False):
        super().__init__()
        self.same_crop = same_crop   # pairs (i, i) only: a frozen teacher distilled on the student's own view
        if student_temp <= 0:
            raise ValueError(f"student_temp must be > 0, got {student_temp}")
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.gather_distributed = gather_distributed
        self.register_buffer("center", torch.zeros(1, out_dim))
        mark_rank_local_state(self, ["center"])

    def forward(self, student_out: list[torch.Tensor], teacher_out: list[torch.Tensor],
                teacher_temp: float) -> torch.Tensor:
        if len(teacher_out) < 1 or len(student_out) < (len(teacher_out) if self.same_crop else 2):
            raise ValueError(f"DINO needs >= 1 teacher and >= {'as many' if self.same_crop else 2} student crops, got "
                             f"{len(teacher_out)} and {len(student_out)}")
        if teacher_temp <= 0:
            raise ValueError(f"teacher_temp must be > 0, got {teacher_temp}")
        with torch.no_grad():
            p_t = [F.softmax((t.detach() - self.center) / teacher_temp, dim=-1) for t in teacher_out]
        log_p_s = [F.log_softmax(s / self.student_temp, dim=-1) for s in student_out]
        total = student_out[0].new_zeros(())
        terms = 0
        for i, p in enumerate(p_t):
            for v, log_p in enumerate(log_p_s):
                if (v == i) != self.same_crop:
                    continue
                total = total + (-(p * log_p).sum(dim=-1)).mean()
                terms += 1
        if terms == 0:
            raise ValueError("DINO: no (teacher crop, student crop) pair with different indices")
        loss = total / terms
        if self.training:
            self.update_center(torch.cat([t.detach() for t in teacher_out]))
        return loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        t = teacher_output.to(self.center.dtype)                  # sum in the centre's precision (AMP)
        stats = torch.cat([t.sum(dim=0), t.new_tensor([float(t.shape[0])])])
        if self.gather_distributed and world_size() > 1:
            stats = all_reduce_no_grad(stats)
        batch_center = (stats[:-1] / stats[-1]).unsqueeze(0)
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)
