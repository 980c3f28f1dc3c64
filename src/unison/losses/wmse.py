"""W-MSE loss: whiten each sub-batch of the embeddings, then pull the views of an image together.

For V views of a global batch of N images, embeddings z_v [N, d], and a partition of the N images into groups
(sub-batches of about ``w_size``, drawn at random each step by the method):

    for each view v and group g (rows S_g, |S_g| = m_g):
        mu_vg    = (1/m_g) sum_{i in S_g} z_vi
        Sigma_vg = (1/(m_g - 1)) sum_{i in S_g} (z_vi - mu_vg)(z_vi - mu_vg)^T          (unbiased, as the paper)
        L_vg L_vg^T = (1 - eps) Sigma_vg + eps I                                          (Cholesky; eps = 0: paper)
        w_vi     = L_vg^{-1} (z_vi - mu_vg)                                               whitened: identity covariance
    L = 1/(T * P) sum_{iterations t} sum_{view pairs a < b} (1/N) sum_i  2 - 2 cos(w_ai, w_bi)

(P = V(V-1)/2 pairs; T = ``w_iter`` random partitions per step, each whitened anew; ``normalize=False``: the plain
MSE of the whitened embeddings instead of 2 - 2 cos.) Whitening makes collapse impossible (the whitened embeddings of
a group have identity covariance), so no negatives are needed (Ermolov et al., 2021; official code ``methods/
w_mse.py``, ``methods/whitening.py``: Cholesky whitening, each view whitened on its own, the same groups for every
view).

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
A group holds images of every rank. Its mean and covariance are sums over its rows, so each is an
`all_reduce_with_grad` of the rank's partial sums: first [sum z, count] per (view, group), then the centred
second moments sum (z - mu)(z - mu)^T per (view, group) with the *global* mean. Every rank then holds the same
whitening matrices, exactly those of one process on the global batch, and whitens its own rows; the loss is the
mean over its own images. With equal local batches the mean over ranks is L, and since the all-reduces' backward
sums over ranks, DDP's gradient average is exactly dL/dtheta (the argument of `unison.losses.vicreg`). The groups
come from the method as global sample positions, a function of (seed, epoch, sample index) only
(`unison.methods.wmse`), so W workers draw the same groups as one. With ``gather_distributed=False`` each rank
whitens its own rows of every group (a smaller-batch loss).

Numerics: the loss runs in float32 under AMP (`in_full_precision`): a Cholesky factor of a half-precision
covariance is meaningless. ``torch.linalg.cholesky_ex`` (no host synchronisation): a covariance that is not
positive definite (a group of at most d images, or a collapsed embedding, with eps = 0) gives a non-finite loss,
which the training step stops on with its cause.

Example::

    loss_fn = WMSELoss()
    z = torch.stack([projector(backbone(v)) for v in views])   # [V, n, d]
    loss = loss_fn(z, groups, n_groups)                         # groups: [w_iter, n] group of each local image
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_with_grad, world_size

from ._precision import in_full_precision


class WMSELoss(nn.Module):
    def __init__(self, eps: float = 0.0, normalize: bool = True, gather_distributed: bool = True):
        super().__init__()
        if not 0 <= eps < 1:
            raise ValueError(f"eps must be in [0, 1), got {eps}")
        self.eps = eps
        self.normalize = normalize
        self.gather_distributed = gather_distributed

    def forward(self, z: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
        """`z`: [V, n, d] (V >= 2 views of this rank's n images); `groups`: int64 [T, n], the group (in
        [0, n_groups)) of each image in each of the T partitions."""
        if z.dim() != 3 or z.shape[0] < 2:
            raise ValueError(f"W-MSE expects embeddings [views >= 2, n, d], got {tuple(z.shape)}")
        if groups.dim() != 2 or groups.shape[1] != z.shape[1]:
            raise ValueError(f"W-MSE expects groups [w_iter, {z.shape[1]}], got {tuple(groups.shape)}")
        return in_full_precision(lambda a, _: self._loss(a, groups, n_groups), z, z)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_with_grad(x) if self.gather_distributed and world_size() > 1 else x

    def whiten(self, z: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
        """z [V, n, d] whitened per (view, group) with the statistics of the group's rows on every rank."""
        v, n, d = z.shape
        member = F.one_hot(group, n_groups).to(z.dtype)                                 # [n, G]
        sums = self._reduce(torch.cat([torch.einsum("ng,vnd->vgd", member, z).reshape(-1), member.sum(0)]))
        counts = sums[-n_groups:].detach()                                              # [G], global
        mean = sums[:-n_groups].reshape(v, n_groups, d) / counts[:, None]
        centred = z - mean[:, group]                                                    # [V, n, d]
        second = self._reduce(torch.einsum("ng,vnd,vne->vgde", member, centred, centred))
        cov = second / (counts - 1)[:, None, None]                                      # [V, G, d, d], unbiased
        if self.eps:
            cov = (1 - self.eps) * cov + self.eps * torch.eye(d, dtype=cov.dtype, device=cov.device)
        factor = torch.linalg.cholesky_ex(cov)[0]                                      # lower, [V, G, d, d]
        return torch.linalg.solve_triangular(factor[:, group], centred.unsqueeze(-1), upper=False).squeeze(-1)

    def _loss(self, z: torch.Tensor, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
        v = z.shape[0]
        total = z.new_zeros(())
        for group in groups:
            w = self.whiten(z, group, n_groups)
            for a in range(v - 1):
                for b in range(a + 1, v):
                    if self.normalize:   # the official norm_mse_loss
                        cos = (F.normalize(w[a], dim=-1) * F.normalize(w[b], dim=-1)).sum(dim=-1)
                        total = total + (2 - 2 * cos).mean()
                    else:
                        total = total + F.mse_loss(w[a], w[b])
        return total / (len(groups) * v * (v - 1) // 2)
