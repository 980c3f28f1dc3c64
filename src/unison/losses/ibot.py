"""iBOT / DINOv2 loss: self-distillation of the class token (DINO) and of masked patch tokens (Zhou et al., 2022).

Head outputs (K prototypes) of the teacher (unmasked global crops, no gradient) and of the
student (global crops with masked patches, plus local crops), temperatures tau_t (teacher,
warmed up by the method) and tau_s = 0.1:

    image level:  L_cls   = mean over pairs (i teacher global crop, v student crop, v != i) of
                            (1/n) sum_b -<P_t(t_i[b]), log softmax(s_v[b] / tau_s)>
    patch level:  L_patch = mean over global crops i of
                            (1/n) sum_b (1/m) sum_{j in M_ib} -<P_t(t_ij[b]), log softmax(s_ij[b] / tau_s)>

where M_ib are the m masked patches of crop i of sample b (the student saw a mask token
there, the teacher the patch) and t_ij, s_ij the patch outputs at j. With ``patch_weights``
(DINOv2's masks: a different number m_ib of masked patches per crop, none in some) the patch
rows are padded to one width and weighted, w_ij[b] = 1 / m_ib at the masked patches and 0 at
the padding, and

                  L_patch = mean over global crops i of (1/n) sum_b sum_j w_ij[b] * -<P_t(t_ij[b]), log softmax(s_ij[b] / tau_s)>

(DINOv2's ``forward_masked``: a crop without masked patches adds 0 and still counts in n); the
padding rows take no part in the teacher's centre or Sinkhorn. The teacher
distribution P_t is, per ``centering``:

* ``"centre"`` (iBOT): softmax((t - c) / tau_t), with one centre for class tokens and one for
  patch tokens, each updated after the loss with the OLD centre as DINO:
  c <- m c + (1 - m) * mean of the teacher outputs over the global batch (m = 0.9). iBOT
  averages every teacher patch token for the patch centre; here the masked ones the loss
  uses (mask positions are uniform, so it is the same mean in expectation, at 1/m the cost).
* ``"sinkhorn"`` (DINOv2): Sinkhorn-Knopp with epsilon = tau_t and 3 iterations over all
  teacher class tokens of the global batch (both global crops together), and separately
  over all masked teacher patch tokens (`unison.losses.swav.sinkhorn`); no centre.

Distributed semantics (``gather_distributed=True``): the centres are updated from
``all_reduce_no_grad`` of [sum of teacher rows, row count], identically on every rank (the
buffers are rank-local and stay bitwise equal); Sinkhorn all-reduces its total and row
sums and uses the global column count, so each rank's codes are the columns of the
single-process codes; with ``patch_weights`` both count the valid rows only (all-reduced), so padding and
the ranks' different numbers of masked patches change nothing. Both terms are means over local samples (every
sample has the same m, or its weights), so the mean over ranks is the global-batch loss and DDP's average its
exact gradient.
With ``gather_distributed=False`` centres and Sinkhorn use the local batch only.

Example::

    loss_fn = IBOTLoss(out_dim=1024)
    l_cls, l_patch = loss_fn(student_cls, teacher_cls, student_patch, teacher_patch, teacher_temp=0.04)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, world_size
from unison.distributed.tagging import mark_rank_local_state

from .swav import sinkhorn

CENTERINGS = ("centre", "sinkhorn")


class IBOTLoss(nn.Module):
    center: torch.Tensor
    patch_center: torch.Tensor

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9,
                 centering: str = "centre", sinkhorn_iterations: int = 3, gather_distributed: bool = True):
        super().__init__()
        if centering not in CENTERINGS:
            raise ValueError(f"centering must be one of {', '.join(CENTERINGS)}, got {centering!r}")
        if student_temp <= 0:
            raise ValueError(f"student_temp must be > 0, got {student_temp}")
        self.student_temp, self.center_momentum = student_temp, center_momentum
        self.centering, self.sinkhorn_iterations = centering, sinkhorn_iterations
        self.gather_distributed = gather_distributed
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.register_buffer("patch_center", torch.zeros(1, out_dim))
        mark_rank_local_state(self, ["center", "patch_center"])

    @torch.no_grad()
    def teacher_probs(self, logits: torch.Tensor, temp: float, center: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
        """P_t for teacher outputs [rows, K] (all rows of this rank, any crops); `valid`: the rows that are not
        padding (the others take no part in Sinkhorn)."""
        if self.centering == "sinkhorn":
            return sinkhorn(logits, epsilon=temp, iterations=self.sinkhorn_iterations,
                            gather_distributed=self.gather_distributed, valid=valid)
        return F.softmax((logits - center) / temp, dim=-1)

    def forward(self, student_cls: list[torch.Tensor], teacher_cls: list[torch.Tensor],
                student_patch: list[torch.Tensor], teacher_patch: list[torch.Tensor],
                teacher_temp: float, patch_weights: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """student_cls: per crop [n, K] (global crops first); teacher_cls: per global crop [n, K];
        student_patch / teacher_patch: per global crop [n, m, K] at the masked patches; `patch_weights`: per
        global crop [n, m], each masked patch's weight (1 / its crop's count; 0: padding), or None (all 1 / m)."""
        n_global = len(teacher_cls)
        if n_global < 1 or len(student_cls) < 2 or len(student_patch) != n_global or len(teacher_patch) != n_global:
            raise ValueError(f"iBOT needs >= 1 teacher crop, >= 2 student crops and the patches of every teacher crop; "
                             f"got {n_global}, {len(student_cls)}, {len(student_patch)}, {len(teacher_patch)}")
        if teacher_temp <= 0:
            raise ValueError(f"teacher_temp must be > 0, got {teacher_temp}")
        n, m, k = teacher_patch[0].shape
        if patch_weights is not None and (len(patch_weights) != n_global
                                          or any(w.shape != (n, m) for w in patch_weights)):
            raise ValueError(f"patch_weights must be one [n, m] = [{n}, {m}] tensor per global crop, got "
                             f"{[tuple(w.shape) for w in patch_weights]}")
        weights = None if patch_weights is None else torch.cat([w.reshape(n * m) for w in patch_weights])
        valid = None if weights is None else weights > 0                                  # [g n m]
        t_cls = torch.cat([t.detach() for t in teacher_cls])                              # [g n, K]
        t_patch = torch.cat([t.detach().reshape(n * m, k) for t in teacher_patch])        # [g n m, K]
        p_cls = self.teacher_probs(t_cls, teacher_temp, self.center).split(n)
        p_patch = self.teacher_probs(t_patch, teacher_temp, self.patch_center, valid).split(n * m)

        log_s_cls = [F.log_softmax(s / self.student_temp, dim=-1) for s in student_cls]
        pairs = [(i, v) for i in range(n_global) for v in range(len(student_cls)) if v != i]
        loss_cls = sum(-(p_cls[i] * log_s_cls[v]).sum(dim=-1).mean() for i, v in pairs) / len(pairs)
        ce = [-(p_patch[i] * F.log_softmax(s.reshape(n * m, k) / self.student_temp, dim=-1)).sum(dim=-1)
              for i, s in enumerate(student_patch)]                                       # per crop [n m]
        if weights is None:
            loss_patch = sum(c.mean() for c in ce) / n_global
        else:
            loss_patch = sum((c * w).sum() / n for c, w in zip(ce, weights.split(n * m))) / n_global
        if self.training and self.centering == "centre":
            self._update(self.center, t_cls)
            self._update(self.patch_center, t_patch, valid)
        return loss_cls, loss_patch

    @torch.no_grad()
    def _update(self, center: torch.Tensor, teacher_rows: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        t = teacher_rows.to(center.dtype)
        if valid is None:
            stats = torch.cat([t.sum(dim=0), t.new_tensor([float(t.shape[0])])])
        else:   # the mean of the valid rows; no valid row anywhere: the centre is kept
            t = torch.where(valid.unsqueeze(1), t, torch.zeros((), dtype=t.dtype, device=t.device))
            stats = torch.cat([t.sum(dim=0), valid.sum().to(t.dtype).reshape(1)])
        if self.gather_distributed and world_size() > 1:
            stats = all_reduce_no_grad(stats)
        if valid is None:
            batch_mean = stats[:-1] / stats[-1]
        else:
            batch_mean = torch.where(stats[-1] > 0, stats[:-1] / stats[-1].clamp(min=1), center[0])
        center.mul_(self.center_momentum).add_(batch_mean.unsqueeze(0), alpha=1 - self.center_momentum)
