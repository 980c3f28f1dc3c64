"""DenseCL loss: MoCo's InfoNCE on the global embeddings plus InfoNCE between matched cells of two feature maps.

For a query view (online encoder) and a key view (momentum encoder, no gradient) of each image:

    q, k       [n, D]     global projections (MLP on the pooled backbone feature), L2-normalised
    q_s, k_t   [n, S, D]  dense projections of every cell s of the query's map, t of the key's, L2-normalised
    f_s, g_t   [n, S, C]  the backbone's own feature of each cell (query, key): what positives are matched by
    Q, Q_d     [K, D]     the global queue (past keys k) and the dense queue (past pooled dense keys, normalised)

    t(s)      = argmax_t cos(f_s, g_t)                                   the key cell most similar to query cell s
    L_global  = mean_i -log( e^{<q_i, k_i>/T} / (e^{<q_i, k_i>/T} + sum_j e^{<q_i, Q_j>/T}) )
    L_dense   = mean_{i, s} -log( e^{<q_is, k_it(s)>/T} / (e^{<q_is, k_it(s)>/T} + sum_j e^{<q_is, Q_dj>/T}) )
    L         = (1 - lambda) * L_global + lambda * L_dense

with T = 0.2 and lambda = 0.5 (Wang et al., 2021, and their code ``WXinlong/DenseCL``: ``ContrastiveHead`` at
temperature 0.2, ``loss_lambda``; each cell's negatives are the dense queue, filled with each key image's mean dense
projection). Both terms are `unison.losses.moco.MoCoLoss`. Lightly ships DenseCL's heads and the matching
(``select_most_similar``) and scores both terms with ``NTXentLoss`` over a memory bank; on the same queues this loss
equals theirs to 1e-9 (tests/losses/test_densecl.py). (Lightly's example fills its dense bank with every key
cell rather than the pooled key; what goes into the queue is the method's, `unison.methods.densecl`.)

Distributed semantics: like `MoCoLoss`, the loss communicates nothing. A query cell's positive is a cell of the same
image, and its negatives are the queue, so every term is per image: rank r's value is the mean over its images (and
their S cells each, the same S for every image). With the queues identical on every rank (the method's shared
queues) the mean over ranks is the single-process loss on the global batch, and DDP's average its gradient.

Example::

    loss_fn = DenseCLLoss(temperature=0.2, loss_lambda=0.5)
    loss = loss_fn(q, k, queue, q_dense, k_dense, f, g, dense_queue)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moco import MoCoLoss

__all__ = ["DenseCLLoss", "most_similar_cells"]


@torch.no_grad()
def most_similar_cells(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n, S] int64: for each cell of `queries` [n, S, C], the index of the most cosine-similar cell of `keys`
    [n, S', C] of the same image (the first one on a tie)."""
    similarity = F.normalize(queries, dim=-1) @ F.normalize(keys, dim=-1).transpose(1, 2)   # [n, S, S']
    return similarity.argmax(dim=2)


class DenseCLLoss(nn.Module):
    def __init__(self, temperature: float = 0.2, loss_lambda: float = 0.5):
        super().__init__()
        if not 0 <= loss_lambda <= 1:
            raise ValueError(f"loss_lambda must be in [0, 1], got {loss_lambda}")
        self.infonce = MoCoLoss(temperature)
        self.loss_lambda = loss_lambda

    def forward(self, q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, q_dense: torch.Tensor,
                k_dense: torch.Tensor, q_features: torch.Tensor, k_features: torch.Tensor, dense_queue: torch.Tensor,
                loss_lambda: float | None = None) -> torch.Tensor:
        """`q`, `k` [n, D]; `q_dense` [n, S, D] and `k_dense` [n, S', D] (dense projections), `q_features` [n, S, C]
        and `k_features` [n, S', C] (the backbone's cells they were projected from); `queue`, `dense_queue` [K, D].
        `loss_lambda`: this step's weight of the dense term (None: the constructor's; a warm-up sets 0)."""
        lam = self.loss_lambda if loss_lambda is None else loss_lambda
        if q_dense.dim() != 3 or k_dense.shape[0::2] != q_dense.shape[0::2] or \
                q_features.shape[:2] != q_dense.shape[:2] or k_features.shape[:2] != k_dense.shape[:2]:
            raise ValueError(f"dense projections [n, S, D] and backbone cells [n, S, C] of query and key expected, got "
                             f"{tuple(q_dense.shape)}, {tuple(k_dense.shape)}, {tuple(q_features.shape)}, "
                             f"{tuple(k_features.shape)}")
        match = most_similar_cells(q_features.detach(), k_features.detach())
        positive = k_dense.gather(1, match[..., None].expand(-1, -1, k_dense.shape[-1]))
        dense = self.infonce(q_dense.flatten(0, 1), positive.flatten(0, 1), dense_queue)
        return (1 - lam) * self.infonce(q, k, queue) + lam * dense
