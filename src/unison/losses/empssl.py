"""EMP-SSL loss: the total coding rate of each patch's embeddings, plus invariance to the mean of the patches.

For a global batch of N images with P patches each, L2-normalised embeddings z_p [N, d] of patch p:

    R(Z_p)  = 1/2 logdet(I_d + d / (N eps) Z_p^T Z_p)                 total coding rate (TCR) of patch p's batch
    zbar_i  = (1/P) sum_p z_pi                                        the mean of image i's patches (with gradient)
    L       = -(1/P) sum_p R(Z_p)  -  lambda (1/P) sum_p (1/N) sum_i cos(z_pi, zbar_i)

with eps = 0.2 and lambda = 200 (Tong et al., 2023; official code ``main.py``: ``TotalCodingRate(eps)`` whose loss
is -logdet/2, ``cal_TCR`` averaged over the patches, ``Similarity_Loss`` with the patch mean not detached; eps as
the code has it, not squared as in the paper's formula). Maximising the coding rate spreads each patch's
embeddings over the whole space (no collapse); the invariance term makes every patch of an image embed like the
image's mean.

Lightly's ``EMPSSLLoss`` (1.6.0) adds ``tcr_loss`` = +logdet/2 where the paper and its code subtract it: it would
minimise the coding rate. This loss follows the paper (tests/losses/test_empssl.py checks the invariance term
and the coding rate against Lightly's functions, the coding rate with the paper's sign).

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
The coding rate needs the covariance of the global batch: Z_p^T Z_p = sum over ranks of each rank's Z_p^T Z_p
([P, d, d]), summed with `all_reduce_with_grad` in one collective, and N is the global number of images. Every rank
then computes the same coding rates, exactly one process's on the global batch; the invariance term is a mean over
the rank's own images. Rank r returns L_r = -(1/P) sum_p R(Z_p) - lambda * (its local mean), so the mean over ranks
is L, and as the all-reduce's backward sums over ranks, DDP's gradient average is exactly dL/dtheta (the argument of
`unison.losses.barlowtwins`): the global term appears once on every rank. With ``gather_distributed=False`` each rank
takes the coding rate of its own images (a smaller-batch loss, the official code's on one GPU).

Numerics: I + c Z^T Z is symmetric positive definite, so logdet = 2 sum log diag(cholesky) (``cholesky_ex``: no
host synchronisation); float32 under AMP (`in_full_precision`).

Example::

    loss_fn = EMPSSLLoss()
    z = torch.stack([F.normalize(projector(backbone(p)), dim=1) for p in patches])   # [P, n, d]
    loss = loss_fn(z)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_with_grad, world_size

from ._precision import in_full_precision


def coding_rate(gram: torch.Tensor, n: int | torch.Tensor, eps: float) -> torch.Tensor:
    """1/2 logdet(I + d / (n eps) gram) for each gram [..., d, d] = Z^T Z of n rows (the total coding rate)."""
    d = gram.shape[-1]
    eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
    factor = torch.linalg.cholesky_ex(eye + (d / (n * eps)) * gram)[0]
    return torch.log(torch.diagonal(factor, dim1=-2, dim2=-1)).sum(dim=-1)   # 1/2 logdet = sum log diag(L)


class EMPSSLLoss(nn.Module):
    def __init__(self, tcr_eps: float = 0.2, inv_weight: float = 200.0, tcr_weight: float = 1.0,
                 gather_distributed: bool = True):
        super().__init__()
        if tcr_eps <= 0:
            raise ValueError(f"tcr_eps must be > 0, got {tcr_eps}")
        self.tcr_eps, self.inv_weight, self.tcr_weight = tcr_eps, inv_weight, tcr_weight
        self.gather_distributed = gather_distributed

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """`z`: [P, n, d], patch p of this rank's image i at z[p, i] (L2-normalised by the method, as the paper)."""
        if z.dim() != 3 or z.shape[0] < 2:
            raise ValueError(f"EMP-SSL expects embeddings [patches >= 2, n, d], got {tuple(z.shape)}")
        return in_full_precision(lambda a, _: self._loss(a), z, z)

    def invariance(self, z: torch.Tensor) -> torch.Tensor:
        """-(1/P) sum_p mean_i cos(z_pi, zbar_i) over this rank's images."""
        return -F.cosine_similarity(z, z.mean(dim=0, keepdim=True), dim=-1).mean()

    def tcr(self, z: torch.Tensor) -> torch.Tensor:
        """(1/P) sum_p R(Z_p) over the global batch (the local one with gather off)."""
        gram = torch.einsum("pnd,pne->pde", z, z)
        if not (self.gather_distributed and world_size() > 1):
            return coding_rate(gram, z.shape[1], self.tcr_eps).mean()
        stats = all_reduce_with_grad(torch.cat([gram.reshape(-1), gram.new_full((1,), float(z.shape[1]))]))
        return coding_rate(stats[:-1].reshape(gram.shape), stats[-1].detach(), self.tcr_eps).mean()

    def _loss(self, z: torch.Tensor) -> torch.Tensor:
        loss = self.inv_weight * self.invariance(z)
        if self.tcr_weight:
            loss = loss - self.tcr_weight * self.tcr(z)
        return loss
