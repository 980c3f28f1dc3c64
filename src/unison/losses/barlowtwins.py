"""Barlow Twins loss: cross-correlation of the two views' embeddings pushed to the identity.

For the global batch of N samples, embeddings z_a, z_b [N, d] are standardised per
dimension with the statistics of the *global* batch (as the original, which uses a
synchronised, non-affine batch norm):

    zn = (z - mean_N(z)) / sqrt(var_N(z) + eps)          (biased variance, eps = 1e-5)
    C  = zn_a^T zn_b / N                                  ([d, d] cross-correlation)
    L  = sum_i (1 - C_ii)^2  +  lambda * sum_{i != j} C_ij^2     (lambda = 5e-3)

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
Rank r holds rows Z_r. The sums that define the mean, the variance and C are sums over
rows, so each is computed as ``all_reduce_with_grad`` of the rank's partial sum (three
all-reduces: [sum z, count], sum (z - mean)^2, zn_a^T zn_b). Every rank then holds the
same global C and returns the same value L_r = L.

Why L on every rank (not L / W) gives the exact gradient. DDP averages the ranks'
gradients, i.e. it descends (1/W) * sum_s L_s. Autograd through collectives whose
backward sums over ranks (`all_reduce_with_grad`) computes on rank r the exact
derivative of sum_s L_s with respect to r's inputs:

    g_r = d(sum_s L_s)/dZ_r * dZ_r/dtheta = W * dL/dZ_r * dZ_r/dtheta      (all L_s = L)
    DDP: (1/W) * sum_r g_r = sum_r dL/dZ_r * dZ_r/dtheta = dL/dtheta             (chain rule)

which is the single-process gradient on the global batch. (The official code and
solo-learn all-reduce C with the non-autograd ``dist.all_reduce``: rank r then only gets
dL/dZ_r, and the average is dL/dtheta / W, W times too small; barlowtwins#8.) Tested in
tests/methods/test_methods.py with real processes.

With ``gather_distributed=False`` each rank standardises and correlates its local batch
only (a different, smaller-batch loss).

Example::

    loss_fn = BarlowTwinsLoss(lambda_offdiag=5e-3)
    loss = loss_fn(projector(backbone(view_a)), projector(backbone(view_b)))
"""

from __future__ import annotations

import torch
import torch.nn as nn

from unison.distributed.collectives import all_reduce_with_grad, world_size

from ._precision import check_embedding_pair, in_full_precision


class BarlowTwinsLoss(nn.Module):
    def __init__(self, lambda_offdiag: float = 5e-3, eps: float = 1e-5, gather_distributed: bool = True):
        super().__init__()
        if lambda_offdiag < 0:
            raise ValueError(f"lambda_offdiag must be >= 0, got {lambda_offdiag}")
        self.lambda_offdiag = lambda_offdiag
        self.eps = eps
        self.gather_distributed = gather_distributed

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        check_embedding_pair(z_a, z_b)
        return in_full_precision(self._loss, z_a, z_b)  # batch statistics: float32 under AMP

    def _loss(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        d = z_a.shape[1]
        if self.gather_distributed and world_size() > 1:
            reduce = all_reduce_with_grad
        else:
            def reduce(x: torch.Tensor) -> torch.Tensor:
                return x
        z = torch.cat([z_a, z_b], dim=1)                                      # [n, 2d]
        sums = reduce(torch.cat([z.sum(0), z.new_full((1,), float(z.shape[0]))]))
        count = sums[-1].detach()                                             # global N
        centred = z - sums[:-1] / count
        var = reduce((centred * centred).sum(0)) / count                      # biased, global
        zn = centred * torch.rsqrt(var + self.eps)
        zn_a, zn_b = zn[:, :d], zn[:, d:]
        c = reduce(zn_a.T @ zn_b) / count                                     # [d, d], global
        eye = torch.eye(d, dtype=torch.bool, device=c.device)
        on_diag = (torch.diagonal(c) - 1).pow(2).sum()
        off_diag = c.masked_fill(eye, 0).pow(2).sum()
        return on_diag + self.lambda_offdiag * off_diag
