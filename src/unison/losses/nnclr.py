"""NNCLR loss (Dwibedi et al., 2021): InfoNCE whose positive is a nearest neighbour from a support set.

For the global batch of N samples, q_i = NN(z_i, Q) the nearest neighbour of the projection z_i of view a in
the support set Q (cosine similarity, no gradient: `nearest_neighbours`), and p_i the prediction of view b,
all L2-normalised, with temperature T:

    rows:     l_i = -log( exp(<q_i, p_i>/T) / sum_k exp(<q_i, p_k>/T) )          (eq. 2 of the paper)
    columns:  l'_i = -log( exp(<q_i, p_i>/T) / sum_k exp(<q_k, p_i>/T) )         (its symmetric term, sect. 3.2)
    L(q, p) = (1/N) sum_i (l_i + l'_i) / 2          (``symmetric=False``: (1/N) sum_i l_i)

The negatives are the other samples' predictions (rows) or nearest neighbours (columns) only, as in the paper:
not NT-Xent's 2N - 1 candidates that Lightly's NNCLR example scores with. `unison.methods.nnclr.NNCLR` applies
L in both directions, (L(NN(z_a), p_b) + L(NN(z_b), p_a)) / 2.

Distributed semantics (``gather_distributed=True``): the predictions carry gradient and are gathered with
`all_gather_with_grad`; the nearest neighbours carry none and are gathered with `gather_no_grad`. Each rank
scores its local n rows against the N global columns in both terms, so its loss is the mean over its local
samples and, with equal local batches, DDP's gradient average is exactly the gradient of L. The nearest
neighbours themselves are exact when the support set is the same on every rank (the method's queue shared by all
workers): a sample's neighbour is then the same whatever rank it lands on. With ``gather_distributed=False``
each rank contrasts its local samples only (a smaller-batch loss).

Precision: under autocast the loss runs in float32 (`in_full_precision`), as NT-Xent does.

Example::

    loss_fn = NNCLRLoss(temperature=0.1)
    q_a = nearest_neighbours(z_a, support)        # support: [K, d], rows L2-normalised
    loss = loss_fn(q_a, predictor(z_b))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, gather_no_grad, rank, world_size

from ._precision import check_embedding_pair, in_full_precision


@torch.no_grad()
def nearest_neighbours(z: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """For each row of `z` [n, d], the row of `support` [K, d] (L2-normalised rows) of highest cosine similarity."""
    if support.dim() != 2 or support.shape[1] != z.shape[1]:
        raise ValueError(f"support set must be [K, {z.shape[1]}], got {tuple(support.shape)}")
    similarity = F.normalize(z.detach().to(support.dtype), dim=1) @ support.T      # [n, K]
    return support.index_select(0, similarity.argmax(dim=1))


class NNCLRLoss(nn.Module):
    def __init__(self, temperature: float = 0.1, symmetric: bool = True, gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.symmetric = symmetric
        self.gather_distributed = gather_distributed

    def forward(self, neighbours: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        """`neighbours` [n, d]: NN(z) of one view (no gradient); `predictions` [n, d]: the other view's."""
        check_embedding_pair(neighbours, predictions)
        return in_full_precision(self._loss, neighbours, predictions)

    def _loss(self, neighbours: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        n = neighbours.shape[0]
        q = F.normalize(neighbours.detach().to(predictions.dtype), dim=1)
        p = F.normalize(predictions, dim=1)
        if self.gather_distributed and world_size() > 1:
            p_all, q_all, offset = all_gather_with_grad(p), gather_no_grad(q), rank() * n
        else:
            p_all, q_all, offset = p, q, 0
        labels = torch.arange(n, device=p.device) + offset
        loss = F.cross_entropy(q @ p_all.T / self.temperature, labels)            # rows: q_i against every p_k
        if self.symmetric:
            loss = 0.5 * (loss + F.cross_entropy(p @ q_all.T / self.temperature, labels))   # p_i against every q_k
        return loss
