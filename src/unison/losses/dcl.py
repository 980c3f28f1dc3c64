"""DCL and DCLW losses (Yeh et al., 2022): InfoNCE with the positive left out of the denominator.

For a global batch of N samples with two views, z_a[i], z_b[i] L2-normalised, the 2N anchors are every z_a[i]
and z_b[i]; anchor u's positive pos(u) is the other view of the same sample and its negatives are the 2N - 2
embeddings of the other samples (both views). Decoupling removes the positive from the denominator (eq. 6 of the
paper, summed over both views):

    l(u) = -w(u) <u, pos(u)> / T  +  log sum_{v not in {u, pos(u)}} exp(<u, v> / T)
    L    = (1 / 2N) * sum_u l(u)

DCL: w = 1. DCLW (`DCLWLoss`): the negative von Mises-Fisher weighting of the positive pair of sample i,

    w_i = 2 - exp(<z_a[i], z_b[i]> / sigma) / mean_j exp(<z_a[j], z_b[j]> / sigma)        (sigma = 0.5)

with the mean over the N samples of the global batch, and no gradient through w (the weights are constants of
the step, as the paper's and Lightly's code detach them). L can be negative: the positive term is no longer
bounded by the denominator.

Distributed semantics (``gather_distributed=True``): as `unison.losses.ntxent`, each rank gathers both views of
every rank with `all_gather_with_grad` and scores its local 2n anchors against the 2N global candidates; each
rank's loss is the mean over its local anchors, so with equal local batches DDP's gradient average is exactly
the gradient of L. DCLW's weights are computed from the gathered pairs, so every rank normalises by the mean
over the global batch and takes its own rows: the weights, and the loss, are those of one process on the global
batch. (Lightly's ``DCLWLoss`` computes the weights from each rank's local pairs even when it gathers the
negatives, so its loss changes with the number of ranks.) With ``gather_distributed=False`` each rank uses its
local negatives and local weights (a smaller-batch loss).

Precision: under autocast the loss runs in float32 (`in_full_precision`), as NT-Xent does.

Example::

    loss_fn = DCLWLoss(temperature=0.1, sigma=0.5)
    loss = loss_fn(projector(backbone(view_a)), projector(backbone(view_b)))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, rank, world_size

from ._precision import check_embedding_pair, in_full_precision


class DCLLoss(nn.Module):
    def __init__(self, temperature: float = 0.1, sigma: float | None = None, gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if sigma is not None and sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        self.temperature = temperature
        self.sigma = sigma          # None: DCL (no weighting); a number: DCLW's von Mises-Fisher weighting
        self.gather_distributed = gather_distributed

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        check_embedding_pair(z_a, z_b)
        return in_full_precision(self._loss, z_a, z_b)

    def _loss(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        n = z_a.shape[0]
        z_a, z_b = F.normalize(z_a, dim=1), F.normalize(z_b, dim=1)
        if self.gather_distributed and world_size() > 1:
            a_all, b_all = all_gather_with_grad(z_a), all_gather_with_grad(z_b)
            offset = rank() * n
        else:
            a_all, b_all, offset = z_a, z_b, 0
        big_n = a_all.shape[0]
        if big_n < 2:
            raise ValueError("DCL needs at least 2 samples in the (global) batch: with one there are no negatives")
        logits = torch.cat([z_a, z_b]) @ torch.cat([a_all, b_all]).T / self.temperature   # [2n, 2N]
        local = torch.arange(n, device=z_a.device) + offset
        self_idx = torch.cat([local, local + big_n])          # each anchor among the candidates
        pos_idx = torch.cat([local + big_n, local])           # its other view
        positive = logits.gather(1, pos_idx[:, None]).squeeze(1)
        excluded = F.one_hot(self_idx, 2 * big_n).bool() | F.one_hot(pos_idx, 2 * big_n).bool()
        negative = torch.logsumexp(logits.masked_fill(excluded, float("-inf")), dim=1)
        if self.sigma is not None:
            positive = positive * self._weights(a_all, b_all, local, self.sigma).repeat(2)
        return (negative - positive).mean()

    @staticmethod
    @torch.no_grad()
    def _weights(a_all: torch.Tensor, b_all: torch.Tensor, local: torch.Tensor, sigma: float) -> torch.Tensor:
        """DCLW's w_i for this rank's samples (global indices `local`), normalised over the whole batch."""
        s = (a_all * b_all).sum(dim=1) / sigma
        return (2 - s.shape[0] * torch.softmax(s, dim=0))[local]


class DCLWLoss(DCLLoss):
    """DCL with the negative von Mises-Fisher weighting of the positive pair (module docstring)."""

    def __init__(self, temperature: float = 0.1, sigma: float = 0.5, gather_distributed: bool = True):
        super().__init__(temperature, sigma, gather_distributed)
