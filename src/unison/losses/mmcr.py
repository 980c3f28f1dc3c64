"""MMCR loss: maximum manifold capacity, the nuclear norm of the views' centroids over the global batch.

For a global batch of N images with k views each, embeddings z_iv (L2-normalised, [d]) of view v of image i:

    c_i  = (1/k) sum_v z_iv                                   centroid of image i's manifold
    C    = [c_1; ...; c_N]                                    [N, d]
    L    = -||C||_*  +  lambda * (1/N) sum_i ||Z_i||_*        Z_i = [z_i1; ...; z_ik]  ([k, d])

||.||_* is the nuclear norm (the sum of singular values, `torch.linalg.svdvals`). Maximising ||C||_* spreads the
centroids over many directions (a high-rank, "capacious" set of manifolds); as every z_iv has unit norm, a centroid
is long only where its views agree, so the same term also pulls each image's views together. The second term
(lambda = 0 in the paper's CIFAR runs) shrinks each image's own manifold directly (Yerxa et al., 2023; official
code ``mmcr/cifar_stl/loss_mmcr.py``).

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
The nuclear norm is not a sum over images: it needs the singular values of the whole [N, d] matrix. Each rank
computes its local centroids [n, d] and gathers every rank's with `all_gather_with_grad` (rows in rank order; the
singular values do not depend on the row order), so every rank computes the same ||C||_* of the global batch. The
per-image term is a mean over the rank's own images. Rank r returns

    L_r = -||C||_*  +  lambda * (1/n) sum_{i in r} ||Z_i||_*

so the mean over ranks is L. Gradients: the gather's backward sums over ranks, so autograd on rank r computes
d(sum_s L_s)/dZ_r, and sum_s L_s = W * L in its global term; DDP's average (1/W) sum_r of these is exactly dL/dtheta
(the argument of `unison.losses.vicreg`): the global term appears once on every rank, not divided by W. (The official
code gathers with the non-differentiable ``dist.all_gather`` and puts its own rows back in: each rank then gets only
dL/dZ_r and DDP's average is dL/dtheta / W.) With ``gather_distributed=False`` each rank takes the nuclear norm of
its own centroids (a smaller-batch loss).

Precision: singular values of [N, d] products lose too much in half precision, so under AMP the loss runs in float32
(`in_full_precision`).

Example::

    loss_fn = MMCRLoss()
    z = torch.stack([projector(backbone(v)) for v in views])   # [k, n, d]
    loss = loss_fn(z)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, world_size

from ._precision import in_full_precision


class MMCRLoss(nn.Module):
    def __init__(self, lambda_local: float = 0.0, gather_distributed: bool = True):
        super().__init__()
        if lambda_local < 0:
            raise ValueError(f"lambda_local must be >= 0, got {lambda_local}")
        self.lambda_local = lambda_local
        self.gather_distributed = gather_distributed

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """`z`: [k, n, d], view v of this rank's image i at z[v, i] (not yet normalised)."""
        if z.dim() != 3 or z.shape[0] < 1:
            raise ValueError(f"MMCR expects embeddings [views, n, d], got {tuple(z.shape)}")
        return in_full_precision(lambda a, _: self._loss(a), z, z)

    def _loss(self, z: torch.Tensor) -> torch.Tensor:
        z = F.normalize(z, dim=-1)
        centroids = z.mean(dim=0)                                              # [n, d]
        if self.gather_distributed and world_size() > 1:
            centroids = all_gather_with_grad(centroids)                        # [N, d], global
        loss = -torch.linalg.svdvals(centroids).sum()
        if self.lambda_local:
            local = torch.linalg.svdvals(z.transpose(0, 1)).sum(dim=-1)         # ||Z_i||_* of each image [n]
            loss = loss + self.lambda_local * local.mean()
        return loss
