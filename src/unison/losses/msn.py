"""MSN loss (Assran et al., 2022): masked anchors predict the sharpened prototype assignment of the target view.

Anchor embeddings a (the masked view and the focal views of every sample, [V n, d]), target embeddings t (the
unmasked view through the EMA target network, [n, d], no gradient), K learnable prototypes P [K, d]; every row
L2-normalised:

    p_a   = softmax(a P^T / tau)                                      anchor predictions    (tau = 0.1)
    p_t   = sharpen(softmax(t P^T / tau), T),  sharpen(p, T)_k = p_k^(1/T) / sum_j p_j^(1/T)   (T = 0.25)
    p_t  <- Sinkhorn-Knopp(p_t)                                       (3 iterations, no gradient; optional)
    CE    = (1/(V n)) sum_anchors -<p_t, log p_a>                     each anchor against its sample's target
    p_bar = mean of p_a over every anchor of the GLOBAL batch
    R     = sum_k p_bar_k log p_bar_k + log K  =  KL(p_bar || uniform)    mean-entropy maximisation (ME-MAX)
    L     = CE + lambda R                                             (lambda = 1)

`MSNLoss.regularizer` is R; PMSN (`unison.losses.pmsn`) replaces it with KL(p_bar || power-law prior).

Distributed semantics (``gather_distributed=True``): the targets are balanced by Sinkhorn-Knopp over the global
batch (`unison.losses.swav.sinkhorn_balance`: total and prototype sums all-reduced, the global sample count), so a
rank's targets are the columns of the single-process targets. p_bar is the global mean: ``all_reduce_with_grad``
of [sum of this rank's p_a, its anchor count]; its backward sums every rank's gradient of R, so with DDP's average
the gradient is exactly that of R on the global batch (the official ``AllReduce`` averages in the forward and
passes the gradient through unchanged, which gives the same gradient). CE is a mean of per-anchor terms. Each
rank returns its local CE + lambda R: the mean over ranks is L of one process on the global batch. With
``gather_distributed=False`` Sinkhorn and p_bar use the local batch only (Lightly's MSNLoss always averages p_bar
locally). Half-precision inputs run in float32 (`in_full_precision`): p^(1/T) and the softmax over K prototypes
underflow in float16, and the official code converts the embeddings to float32 too.

Example::

    loss_fn = MSNLoss()
    loss = loss_fn(anchor_embeddings, target_embeddings, prototypes.weight, sharpen_temperature=0.25)
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_with_grad, world_size

from ._precision import in_full_precision
from .swav import sinkhorn_balance


def sharpen(probabilities: torch.Tensor, temperature: float) -> torch.Tensor:
    """p^(1/T), renormalised per row (MSN's target sharpening; T < 1 sharpens)."""
    p = probabilities ** (1.0 / temperature)
    return p / p.sum(dim=1, keepdim=True)


class MSNLoss(nn.Module):
    def __init__(self, temperature: float = 0.1, sinkhorn_iterations: int = 3, regularization_weight: float = 1.0,
                 gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if sinkhorn_iterations < 0:
            raise ValueError(f"sinkhorn_iterations must be >= 0, got {sinkhorn_iterations}")
        self.temperature, self.sinkhorn_iterations = temperature, sinkhorn_iterations
        self.regularization_weight = regularization_weight
        self.gather_distributed = gather_distributed

    def forward(self, anchors: torch.Tensor, targets: torch.Tensor, prototypes: torch.Tensor,
                sharpen_temperature: float = 0.25) -> torch.Tensor:
        """anchors [V n, d] (V anchor views of the n samples, view-major), targets [n, d], prototypes [K, d]."""
        if anchors.dim() != 2 or targets.dim() != 2 or prototypes.dim() != 2 or targets.shape[0] == 0 \
                or anchors.shape[0] % targets.shape[0] or not anchors.shape[1] == targets.shape[1] == prototypes.shape[1]:
            raise ValueError(f"expected anchors [V n, d], targets [n, d] and prototypes [K, d], got "
                             f"{tuple(anchors.shape)}, {tuple(targets.shape)} and {tuple(prototypes.shape)}")
        if sharpen_temperature <= 0:
            raise ValueError(f"sharpen_temperature must be > 0, got {sharpen_temperature}")
        return in_full_precision(lambda a, t, p: self._loss(a, t, p, sharpen_temperature), anchors, targets, prototypes)

    def _loss(self, anchors: torch.Tensor, targets: torch.Tensor, prototypes: torch.Tensor,
              sharpen_temperature: float) -> torch.Tensor:
        views = anchors.shape[0] // targets.shape[0]
        protos = F.normalize(prototypes, dim=1)
        log_p_a = F.log_softmax(F.normalize(anchors, dim=1) @ protos.T / self.temperature, dim=1)
        with torch.no_grad():
            p_t = F.softmax(F.normalize(targets.detach(), dim=1) @ protos.detach().T / self.temperature, dim=1)
            p_t = sharpen(p_t, sharpen_temperature)
            if self.sinkhorn_iterations:
                p_t = sinkhorn_balance(p_t, self.sinkhorn_iterations, self.gather_distributed)
            p_t = p_t.repeat(views, 1)
        loss = -(p_t * log_p_a).sum(dim=1).mean()
        if self.regularization_weight > 0:
            loss = loss + self.regularization_weight * self.regularizer(self.mean_prediction(log_p_a.exp()))
        return loss

    def mean_prediction(self, probabilities: torch.Tensor) -> torch.Tensor:
        """p_bar [K]: the mean of the anchor predictions over the global batch (differentiable, see the module
        docstring), or over the local batch with ``gather_distributed=False``."""
        stats = torch.cat([probabilities.sum(dim=0), probabilities.new_tensor([float(probabilities.shape[0])])])
        if self.gather_distributed and world_size() > 1:
            stats = all_reduce_with_grad(stats)
        return stats[:-1] / stats[-1]

    def regularizer(self, mean_probabilities: torch.Tensor) -> torch.Tensor:
        """ME-MAX: sum_k p_bar_k log p_bar_k + log K = KL(p_bar || uniform), 0 when every prototype is used equally."""
        return torch.special.xlogy(mean_probabilities, mean_probabilities).sum() + math.log(mean_probabilities.numel())
