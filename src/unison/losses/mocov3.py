"""MoCo v3 loss: InfoNCE of each query against the momentum keys of the whole global batch (Chen et al., 2021).

Queries q (online encoder + projector + predictor, with gradient) and keys k (momentum
encoder + projector, no gradient), both L2-normalised; for the n local queries of rank r and
the N keys of the global batch, temperature T:

    l_i = -log( exp(<q_i, k_i>/T) / sum_{j=1..N} exp(<q_i, k_j>/T) )
    L   = 2T * (1/n) sum_i l_i

The factor 2T is the official code's (``nn.CrossEntropyLoss()(logits, labels) * (2 * T)``),
which keeps the gradient scale independent of T. The method symmetrises:
``L(q_a, k_b) + L(q_b, k_a)`` (a sum, as the official code).

Distributed semantics (``gather_distributed=True``): the keys carry no gradient, so gathering
them without autograd (`gather_no_grad`) is exact; each rank scores only its local queries
against all N keys (positive of local query i: global row ``rank * n + i``). Each rank's loss
is the mean over its local queries, so with equal local batches the mean over ranks is the
global-batch loss and DDP's average is its exact gradient. With ``gather_distributed=False``
each rank uses only its local keys as negatives (a smaller-batch loss).

Example::

    loss_fn = MoCoV3Loss(temperature=0.2)
    loss = loss_fn(q_a, k_b) + loss_fn(q_b, k_a)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import gather_no_grad, rank, world_size


class MoCoV3Loss(nn.Module):
    def __init__(self, temperature: float = 0.2, gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.gather_distributed = gather_distributed

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if q.shape != k.shape or q.dim() != 2:
            raise ValueError(f"expected queries and keys [n, d] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
        n = q.shape[0]
        q = F.normalize(q, dim=1)
        k = F.normalize(k.detach(), dim=1)
        offset = 0
        if self.gather_distributed and world_size() > 1:
            k, offset = gather_no_grad(k), rank() * n
        logits = q @ k.T / self.temperature                                   # [n, N]
        labels = torch.arange(n, device=q.device) + offset
        return F.cross_entropy(logits, labels) * (2 * self.temperature)
