"""MoCo loss: InfoNCE of each query against its positive key and a queue of negative keys.

For a query q_i, its positive key k_i (from the momentum encoder, no gradient) and the
queue Q = [Q_1 .. Q_K] of past keys, all L2-normalised, with temperature T:

    l_i  = -log( exp(<q_i, k_i>/T) / (exp(<q_i, k_i>/T) + sum_j exp(<q_i, Q_j>/T)) )
    L    = (1/n) * sum_i l_i                      (mean over this rank's queries)

The negatives of a query are the queue only, as in the official MoCo (the other keys of
the current batch are not negatives), so each query's term depends on no other sample of
the batch.

Distributed semantics: the loss itself communicates nothing. Each rank's value is the
mean over its local queries, so with equal local batches DDP's gradient average is the
gradient of the global-batch mean, provided every rank scores against the same queue.
`unison.methods.moco.MoCo` keeps the queue identical on all ranks when `shared_queue` is
on (keys of every rank gathered without gradient and enqueued everywhere): then the
loss is exactly the single-process loss on the global batch. With per-rank queues each
rank's negatives are its own past keys (a different loss).

Example::

    loss_fn = MoCoLoss(temperature=0.1)
    loss = loss_fn(q, k, queue)            # q: [n, d] (grad), k: [n, d], queue: [K, d]
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoCoLoss(nn.Module):
    def __init__(self, temperature: float = 0.1):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    def forward(self, q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor) -> torch.Tensor:
        if q.shape != k.shape:
            raise ValueError(f"queries and keys differ in shape: {tuple(q.shape)} vs {tuple(k.shape)}")
        if queue.dim() != 2 or queue.shape[1] != q.shape[1]:
            raise ValueError(f"queue must be [K, {q.shape[1]}], got {tuple(queue.shape)}")
        q = F.normalize(q, dim=1)
        k = F.normalize(k.detach(), dim=1)
        l_pos = (q * k).sum(dim=1, keepdim=True)                  # [n, 1]
        l_neg = q @ queue.detach().T                              # [n, K]
        logits = torch.cat([l_pos, l_neg], dim=1) / self.temperature
        labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        return F.cross_entropy(logits, labels)
