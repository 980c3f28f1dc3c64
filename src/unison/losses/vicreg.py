"""VICReg loss: variance-invariance-covariance regularisation of two views' embeddings.

For embeddings z_a, z_b [N, d] of the global batch:

    inv(a, b) = (1 / (N d)) * sum_i ||z_a_i - z_b_i||^2                          (MSE)
    var(z)    = (1 / d) * sum_j max(0, gamma - sqrt(Var_N(z_j) + eps))           (unbiased Var)
    cov(z)    = (1 / d) * sum_{j != k} Cov_N(z)_jk^2,  Cov = (z - mean)^T (z - mean) / (N - 1)
    L         = lambda * inv + mu * (var(z_a) + var(z_b)) / 2 + nu * (cov(z_a) + cov(z_b))

with lambda = mu = 25, nu = 1, gamma = 1, eps = 1e-4 (Bardes et al., 2022; the official
code's weighting: variance averaged over the views, covariance summed).

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
The invariance term is per sample: rank r uses the mean over its local rows, inv_r.
The variance and covariance terms need the whole batch: rank r gathers both views of
every rank with `all_gather_with_grad` (one collective, views concatenated along the
feature dimension) and computes V = var terms and Cv = cov terms of the global batch, the
same on every rank. Rank r returns

    L_r = lambda * inv_r + mu * V + nu * Cv.

With equal local batches the mean over ranks is (1/W) sum_r L_r = lambda * inv + mu * V +
nu * Cv = L. Gradients: the gather's backward sums over ranks, so autograd on rank r
computes d(sum_s L_s)/dZ_r, and sum_s L_s = W * L as a function of the global batch;
DDP's average (1/W) sum_r of these is therefore exactly dL/dtheta (the same argument as
in `unison.losses.barlowtwins`). No extra scaling is needed: the global terms appear
*once* per rank, not divided by W. Tested against one process in
tests/methods/test_methods.py.

With ``gather_distributed=False`` the variance and covariance use the local batch only.

Example::

    loss_fn = VICRegLoss()
    loss = loss_fn(projector(backbone(view_a)), projector(backbone(view_b)))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, world_size

from ._precision import check_embedding_pair, in_full_precision


class VICRegLoss(nn.Module):
    def __init__(self, lambda_inv: float = 25.0, mu_var: float = 25.0, nu_cov: float = 1.0, gamma: float = 1.0,
                 eps: float = 1e-4, gather_distributed: bool = True):
        super().__init__()
        self.lambda_inv, self.mu_var, self.nu_cov = lambda_inv, mu_var, nu_cov
        self.gamma, self.eps = gamma, eps
        self.gather_distributed = gather_distributed

    def _variance(self, z: torch.Tensor) -> torch.Tensor:
        std = torch.sqrt(z.var(dim=0) + self.eps)
        return F.relu(self.gamma - std).mean()

    @staticmethod
    def _covariance(z: torch.Tensor) -> torch.Tensor:
        n, d = z.shape
        z = z - z.mean(dim=0)
        cov = (z.T @ z) / (n - 1)
        eye = torch.eye(d, dtype=torch.bool, device=z.device)
        return cov.masked_fill(eye, 0).pow(2).sum() / d

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        check_embedding_pair(z_a, z_b)
        return in_full_precision(self._loss, z_a, z_b)  # batch statistics: float32 under AMP

    def _loss(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        d = z_a.shape[1]
        inv = F.mse_loss(z_a, z_b)                                        # local mean
        if self.gather_distributed and world_size() > 1:
            both = all_gather_with_grad(torch.cat([z_a, z_b], dim=1))    # [N, 2d]
            a, b = both[:, :d], both[:, d:]
        else:
            a, b = z_a, z_b
        if a.shape[0] < 2:
            raise ValueError("VICReg needs at least 2 samples in the (global) batch for variance and covariance")
        var = 0.5 * (self._variance(a) + self._variance(b))
        cov = self._covariance(a) + self._covariance(b)
        return self.lambda_inv * inv + self.mu_var * var + self.nu_cov * cov
