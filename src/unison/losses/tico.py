"""TiCo loss (Zhu et al., 2022): transformation invariance plus contrast against a running covariance matrix.

For the global batch of N samples, online embeddings z_i and target embeddings z'_i (the other view, from the
momentum encoder), both L2-normalised, and the running covariance C [d, d] of the online embeddings:

    B_t = (1/N) sum_i z_i z_i^T                                 (no gradient)
    C_t = beta * C_{t-1} + (1 - beta) * B_t                     (C_0 = 0, beta = 0.9)
    L   = 1 - (1/N) sum_i <z_i, z'_i>  +  rho * (1/N) sum_i z_i^T C_t z_i        (rho = 8)

The first term pulls the two views together; the second pushes each embedding away from the directions the
recent batches occupy (C_t is an implicit memory bank of every past batch, decaying by beta per step). C_t is
computed before the loss and stored after it; it is a constant of the step (no gradient flows into it), as in
Lightly's ``TiCoLoss`` (``B`` detached), and it is stored only in training mode.

Distributed semantics
---------------------
* C is the only cross-sample quantity. With ``gather_distributed=True`` B_t is `all_reduce_no_grad` of
  [sum_i z_i z_i^T, row count] (one collective of d^2 + 1 numbers), so B_t is the GLOBAL batch's and every rank
  applies the identical update: C stays the same on every rank, step after step, and equal to one process's C on
  the global batch (up to the order of the float additions).
* Given the same C, both terms are means of per-sample terms: each rank returns the mean over its local samples,
  so with equal local batches the mean over ranks (DDP's gradient average) is the global-batch loss and its
  gradient, exactly. Under exact gradient accumulation the method's forward sees all K micro-batches of a step,
  so B_t is the whole step's, as with one big batch.
* C is a persistent buffer (saved in checkpoints) marked rank-local, so DDP never re-broadcasts it.
* ``gather_distributed=False``: each rank's B_t is its local batch's; the ranks' C drift apart (not equivalent to
  one process).

Precision: under autocast the loss runs in float32 (`in_full_precision`); C is kept in its own precision.

Example::

    loss_fn = TiCoLoss(dim=256, beta=0.9, rho=8.0)
    loss = loss_fn(projector(backbone(view_a)), momentum_projector(momentum_backbone(view_b)))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, world_size
from unison.distributed.tagging import mark_rank_local_state

from ._precision import check_embedding_pair, in_full_precision


class TiCoLoss(nn.Module):
    covariance: torch.Tensor   # buffer [d, d]: the running covariance C of the online embeddings (rank-local)

    def __init__(self, dim: int, beta: float = 0.9, rho: float = 8.0, gather_distributed: bool = True):
        super().__init__()
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.beta, self.rho = beta, rho
        self.gather_distributed = gather_distributed
        self.register_buffer("covariance", torch.zeros(dim, dim))
        mark_rank_local_state(self, ["covariance"])

    def forward(self, z: torch.Tensor, z_target: torch.Tensor) -> torch.Tensor:
        """`z` [n, d]: the online embeddings (with gradient); `z_target` [n, d]: the other view's targets."""
        check_embedding_pair(z, z_target)
        if z.shape[1] != self.covariance.shape[0]:
            raise ValueError(f"embeddings are {z.shape[1]} wide, the covariance is {self.covariance.shape[0]} wide")
        return in_full_precision(self._loss, z, z_target)

    def _loss(self, z: torch.Tensor, z_target: torch.Tensor) -> torch.Tensor:
        z, z_target = F.normalize(z, dim=1), F.normalize(z_target, dim=1)
        c = self.updated_covariance(z)
        invariance = 1 - (z * z_target).sum(dim=1).mean()
        contrast = self.rho * ((z @ c.to(z.dtype)) * z).sum(dim=1).mean()
        if self.training:
            self.covariance.copy_(c)
        return invariance + contrast

    @torch.no_grad()
    def updated_covariance(self, z: torch.Tensor) -> torch.Tensor:
        """C_t from C_{t-1} and the (global) batch second moment of the normalised embeddings `z`."""
        zc = z.detach().to(self.covariance.dtype)
        d = zc.shape[1]
        stats = torch.cat([(zc.T @ zc).reshape(-1), zc.new_tensor([float(zc.shape[0])])])
        if self.gather_distributed and world_size() > 1:
            stats = all_reduce_no_grad(stats)
        batch = stats[:-1].reshape(d, d) / stats[-1]
        return self.beta * self.covariance + (1 - self.beta) * batch
