"""CAPI loss (Darcet et al., 2025): masked patches predict the online clustering of the teacher's patch features.

Teacher logits l [n, N, K] (the clustering head on the N patch tokens the EMA teacher makes of the full image),
student logits s [n, M, K] (the predictor's outputs at M masked patches, through the student head) and the
predicted patches P [n, M] (indices into the N):

    Q        = SK(l / tau_t)                                   targets, no gradient        (tau_t = 0.06)
    L_capi   = (1/(n M)) sum_b sum_m -<Q[b, P_bm], log softmax(s[b, m] / tau_s)>                (tau_s = 0.12)
    L_clust  = (1/(n N)) sum_b sum_j -<Q[b, j],    log softmax(l[b, j] / tau_c)>                (tau_c = 0.12)

L_capi trains the student (encoder, predictor, head); L_clust trains the clustering head, whose input, the
teacher's features, carries no gradient: the two losses reach disjoint parameters, so the gradient of their sum
is, for every parameter, that of its own loss (the official code runs two backward passes and two optimizers).

SK is the official positionwise Sinkhorn-Knopp (``OnlineClustering`` with ``positionwise_sk``): at every patch
position j on its own, the [B, K] matrix of the global batch's B images is balanced so that every cluster gets
the same mass at that position, then every token's row is made a distribution over the K clusters:

    Q_j = exp(l[:, j] / tau_t - shift_j + c)      shift_j: per cluster, the maximum over the global batch
    repeat 3 times:
        Q_j /= (sum of Q_j over the global batch, per cluster) + 1e-8
        Q_j /= (sum of Q_j over the clusters, per token) + 1e-8

The shift and c cancel in the first division but for its 1e-8 (about 1e-8 relative): c = 50 in float32, as the
official code (``exp_max_values``: each column's largest entry at e^50, against which the 1e-8 is nothing), and 0 in
float64, as Lightly's ``CAPILoss`` at every precision, which a float64 run then equals to the last digits.

Distributed semantics (``gather_distributed=True``): the shift is the maximum over ranks and the per-cluster sums
are all-reduced in every iteration (as the official ``reduced_sum``); the per-token normalisation is local. A
rank's targets are then the rows of the single-process targets on the global batch. Both losses are means of
per-token terms, every sample has the same N and M, so each rank's mean over its local tokens averaged over
ranks is the global loss, and DDP's gradient average its exact gradient. With ``gather_distributed=False``
Sinkhorn balances each rank's local batch. Half-precision logits run in float32 (`in_full_precision`), as the
official code casts them.

Example::

    loss_fn = CAPILoss()
    loss_capi, loss_clust = loss_fn(teacher_logits, student_logits, predicted)   # [n, N, K], [n, M, K], [n, M]
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_max_no_grad, all_reduce_no_grad, world_size

from ._precision import in_full_precision

SINKHORN_EPSILON = 1e-8   # official: added to every denominator
# The official exponent offset c (``exp_max_values``) by working precision; float64: see the module docstring
_EXP_OFFSET = {torch.float64: 0.0}
_DEFAULT_EXP_OFFSET = 50.0


@torch.no_grad()
def positionwise_sinkhorn(logits: torch.Tensor, iterations: int = 3, gather_distributed: bool = True) -> torch.Tensor:
    """Targets [n, N, K] for scaled logits [n, N, K] (``l / tau_t``): each position balanced over the batch, each
    token's row summing to 1; see the module docstring."""
    work = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    q = logits.detach().to(work)
    distributed = gather_distributed and world_size() > 1
    shift = q.amax(dim=0, keepdim=True)                                           # [1, N, K]
    if distributed:
        shift = all_reduce_max_no_grad(shift)
    q = torch.exp(q - shift + _EXP_OFFSET.get(work, _DEFAULT_EXP_OFFSET))
    for _ in range(iterations):
        columns = q.sum(dim=0, keepdim=True)
        if distributed:
            columns = all_reduce_no_grad(columns)
        q = q / (columns + SINKHORN_EPSILON)
        q = q / (q.sum(dim=-1, keepdim=True) + SINKHORN_EPSILON)
    return q


class CAPILoss(nn.Module):
    def __init__(self, teacher_temp: float = 0.06, student_temp: float = 0.12, clustering_temp: float = 0.12,
                 sinkhorn_iterations: int = 3, gather_distributed: bool = True):
        super().__init__()
        if min(teacher_temp, student_temp, clustering_temp) <= 0:
            raise ValueError(f"temperatures must be > 0, got {teacher_temp}, {student_temp} and {clustering_temp}")
        if sinkhorn_iterations < 1:
            raise ValueError(f"sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        self.teacher_temp, self.student_temp, self.clustering_temp = teacher_temp, student_temp, clustering_temp
        self.sinkhorn_iterations = sinkhorn_iterations
        self.gather_distributed = gather_distributed

    def forward(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(L_capi, L_clust) for teacher logits [n, N, K], student logits [n, M, K] at the patches `predicted`
        [n, M] (int64 indices into the N)."""
        t, s = teacher_logits, student_logits
        if t.dim() != 3 or s.dim() != 3 or predicted.dim() != 2 or t.shape[0] != s.shape[0] \
                or t.shape[2] != s.shape[2] or predicted.shape != s.shape[:2]:
            raise ValueError(f"expected teacher logits [n, N, K], student logits [n, M, K] and predicted patches "
                             f"[n, M], got {tuple(t.shape)}, {tuple(s.shape)} and {tuple(predicted.shape)}")
        if predicted.dtype != torch.int64:
            raise ValueError(f"predicted must hold int64 patch indices, got {predicted.dtype}")
        both = in_full_precision(lambda a, b: torch.stack(self._losses(a, b, predicted)), t, s)
        return both[0], both[1]

    def _losses(self, teacher_logits: torch.Tensor, student_logits: torch.Tensor,
                predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = positionwise_sinkhorn(teacher_logits.detach() / self.teacher_temp, self.sinkhorn_iterations,
                                  self.gather_distributed)
        target = q.gather(1, predicted.unsqueeze(-1).expand(-1, -1, q.shape[-1]))
        loss_capi = -(target * F.log_softmax(student_logits / self.student_temp, dim=-1)).sum(dim=-1).mean()
        loss_clust = -(q * F.log_softmax(teacher_logits / self.clustering_temp, dim=-1)).sum(dim=-1).mean()
        return loss_capi, loss_clust
