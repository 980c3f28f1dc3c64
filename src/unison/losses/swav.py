"""SwAV loss: swapped prediction of online codes computed by distributed Sinkhorn-Knopp.

Scores s = <z, c_k> of L2-normalised embeddings z against L2-normalised prototypes c_k
(K of them) are given for every crop v = 0..V-1 (2 global crops first, then local ones),
each [n, K]. For each assignment crop i in {0, 1} the codes q_i [n, K] come from
Sinkhorn-Knopp on that crop's scores (no gradient), and every *other* crop v predicts them:

    p_v   = softmax(s_v / T)                                             (T = 0.1)
    L     = (1/2) sum_{i in {0,1}} (1/(V-1)) sum_{v != i} (1/n) sum_b -<q_i[b], log p_v[b]>

Sinkhorn-Knopp (official ``distributed_sinkhorn``), scores of B columns in all:

    Q = exp(s / eps)^T                 [K, B]     (eps = 0.05)
    Q /= sum(Q)                                    total over all ranks
    repeat 3 times:
        Q /= row sums (over all ranks' columns); Q /= K      each prototype gets mass 1/K
        Q /= column sums (local);               Q /= B      each sample gets mass 1/B
    Q *= B                                          columns are assignments summing to 1

Distributed semantics (``gather_distributed=True``): the total and the row sums are
all-reduced every iteration and B is the *global* number of columns (``all_reduce_no_grad``
of [total, count]); column normalisation is local. The codes of a rank's samples are then
exactly the columns of the single-process codes on the global batch, so the loss (mean
over local samples) averaged over ranks is the global loss and DDP's gradient average is
its exact gradient. With ``gather_distributed=False`` Sinkhorn runs on the local batch.

Optional queue: ``queue_scores[i]`` [m, K] (scores of stored past embeddings against the
current prototypes) are prepended to crop i's columns before Sinkhorn and dropped
afterwards (official SwAV). If the queues of all ranks together hold the same rows as a
single process's queue, the result is still exact (Sinkhorn only sees the set of columns).

Numerics: scores are bounded (|s| <= 1 with normalised z and prototypes), so
exp(s / eps) stays within [e^-20, e^20]; ``float64=True`` runs Sinkhorn in double precision
(as VISSL offers; half-precision scores are always processed in float32), and a zero row or column sum (a prototype that receives no mass
after underflow) is left at zero instead of producing NaNs.

Padded columns: ``valid`` (bool [B_local]) marks the rows of `scores` that are samples; the others (the padding
of a batch whose samples have different numbers of rows, DINOv2's masked patches) get zero weight and a zero
code, and B counts the valid rows only (all-reduced like the total), so the codes of the valid rows are those
of Sinkhorn on the valid rows alone.

Example::

    loss_fn = SwAVLoss(temperature=0.1, epsilon=0.05, iterations=3)
    scores = [prototypes(F.normalize(projector(backbone(v)), dim=1)) for v in views]
    loss = loss_fn(scores)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, world_size


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.ones_like(x))


@torch.no_grad()
def sinkhorn(scores: torch.Tensor, epsilon: float = 0.05, iterations: int = 3, gather_distributed: bool = True,
             float64: bool = False, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Codes [B_local, K] (rows sum to 1) for scores [B_local, K]; see the module docstring. `valid`: the rows
    that are samples (the others padding: zero codes)."""
    out_dtype = scores.dtype
    work = torch.float64 if float64 else (torch.float32 if scores.dtype in (torch.float16, torch.bfloat16)
                                          else scores.dtype)
    s = scores.detach().to(work)
    return sinkhorn_balance(torch.exp(s / epsilon), iterations, gather_distributed, valid).to(out_dtype)


@torch.no_grad()
def sinkhorn_balance(weights: torch.Tensor, iterations: int = 3, gather_distributed: bool = True,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """The Sinkhorn-Knopp iterations of the module docstring on non-negative `weights` [B_local, K] (SwAV's
    exp(s / eps); MSN's sharpened probabilities): every prototype gets mass 1/K, rows of the result sum to 1
    (the rows `valid` marks, when given; the others are 0)."""
    q = weights.detach().T.clone()                                # [K, B_local]
    k = q.shape[0]
    distributed = gather_distributed and world_size() > 1
    if valid is None:
        count = q.new_tensor(float(q.shape[1]))
    else:   # padding weighs nothing (where, not a product: an inf there would be NaN) and is not counted
        q = torch.where(valid.unsqueeze(0), q, torch.zeros((), dtype=q.dtype, device=q.device))
        count = valid.sum().to(q.dtype)
    stats = torch.stack([q.sum(), count])
    if distributed:
        stats = all_reduce_no_grad(stats)
    total, b = stats[0], stats[1]
    q /= _nonzero(total)
    for _ in range(iterations):
        rows = q.sum(dim=1, keepdim=True)
        if distributed:
            rows = all_reduce_no_grad(rows)
        q /= _nonzero(rows)
        q /= k
        q /= _nonzero(q.sum(dim=0, keepdim=True))
        q /= _nonzero(b)   # no valid row anywhere (all padding): codes 0, not 0 / 0
    q *= b
    return q.T


class SwAVLoss(nn.Module):
    def __init__(self, temperature: float = 0.1, epsilon: float = 0.05, iterations: int = 3,
                 n_assign: int = 2, gather_distributed: bool = True, float64: bool = False):
        super().__init__()
        if temperature <= 0 or epsilon <= 0:
            raise ValueError(f"temperature and epsilon must be > 0, got {temperature} and {epsilon}")
        self.temperature, self.epsilon, self.iterations = temperature, epsilon, iterations
        self.n_assign = n_assign
        self.gather_distributed = gather_distributed
        self.float64 = float64

    def codes(self, scores: torch.Tensor, queue_scores: torch.Tensor | None = None) -> torch.Tensor:
        n = scores.shape[0]
        s = scores.detach()
        if queue_scores is not None:
            s = torch.cat([queue_scores.detach(), s])
        return sinkhorn(s, self.epsilon, self.iterations, self.gather_distributed, self.float64)[-n:]

    def forward(self, scores: list[torch.Tensor], queue_scores: list[torch.Tensor] | None = None) -> torch.Tensor:
        n_crops = len(scores)
        if n_crops < max(2, self.n_assign):
            raise ValueError(f"SwAV needs at least {max(2, self.n_assign)} crops, got {n_crops}")
        if any(s.shape != scores[0].shape for s in scores[1:]):
            raise ValueError(f"all crops' scores must be [n, K] of one shape, got {[tuple(s.shape) for s in scores]}")
        log_p = [F.log_softmax(s / self.temperature, dim=1) for s in scores]
        loss = scores[0].new_zeros(())
        for i in range(self.n_assign):
            q = self.codes(scores[i], None if queue_scores is None else queue_scores[i])
            sub = sum(-(q * log_p[v]).sum(dim=1).mean() for v in range(n_crops) if v != i)
            loss = loss + sub / (n_crops - 1)
        return loss / self.n_assign
