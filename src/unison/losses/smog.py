"""SMoG loss: contrast each image with K group features, which move towards the batch synchronously.

Given group features G [K, d], the online projection z and prediction p of view a and the momentum projection z' of
view b (each [N, d] over the global batch):

    y_i     = argmax_k <z'_i, G_k> / (|z'_i| |G_k|)                        view b's group (momentum network, old G)
    a_i     = argmax_k <z_i, G_k> / (|z_i| |G_k|)                          view a's group, for the update
    G'_k    = beta G_k + (1 - beta) mean_{i: a_i = k} z_i                  momentum grouping (groups with members)
    L       = (1/N) sum_i -log softmax_k(<p_i, G'_k> / (|p_i| |G'_k| tau))[y_i]

with beta = 0.99 and tau = 0.1 (Pang et al., 2022). The update is synchronous: the group features of this step
already contain this batch (G' carries the gradient of the batch mean, weight 1 - beta), and G' replaces G after
the step. The paper has no public code; this follows the reading of Lightly's SMoG (``SMoGPrototypes``: argmax
assignments, the online projection in the update, the prediction in the logits), which
tests/losses/test_smog.py checks against.

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
Assignments are per image. The group means are sums over the global batch: each rank's per-group sums of z and
counts are summed with `all_reduce_with_grad` (one collective of K (d + 1) numbers), so every rank computes the
same G', that of one process on the global batch (bitwise equal on every rank: all-reduce results are), and the
method stores it on every rank. The cross-entropy is a mean over the rank's own images, so the mean over ranks is
L, and as the all-reduce's backward sums over ranks, DDP's gradient average is exactly dL/dtheta (also through
G'). With ``gather_distributed=False`` each rank moves its groups towards its own batch (the groups drift apart
across ranks: not one process's).

Example::

    loss_fn = SMoGLoss()
    targets = loss_fn.assign(z_momentum_b, groups)
    new_groups = loss_fn.grouped(z_online_a, groups)
    loss = loss_fn(p_online_a, targets, new_groups); groups.copy_(new_groups.detach())
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_with_grad, world_size


class SMoGLoss(nn.Module):
    def __init__(self, temperature: float = 0.1, beta: float = 0.99, gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0 or not 0 <= beta <= 1:
            raise ValueError(f"temperature must be > 0 and beta in [0, 1], got {temperature} and {beta}")
        self.temperature, self.beta = temperature, beta
        self.gather_distributed = gather_distributed

    def logits(self, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Cosine similarities of x [n, d] to the groups [K, d], over the temperature: [n, K]."""
        return F.normalize(x, dim=1) @ F.normalize(groups, dim=1).T / self.temperature

    @torch.no_grad()
    def assign(self, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """The group of each row of x: int64 [n]."""
        return self.logits(x.detach(), groups.detach()).argmax(dim=1)

    def grouped(self, z: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """G' [K, d]: each group with members in the global batch moved towards their mean of z (with gradient)."""
        k, d = groups.shape
        z = z.to(groups.dtype)                                                    # the groups' precision (AMP)
        member = F.one_hot(self.assign(z, groups), k).to(z.dtype)                # [n, K]
        stats = torch.cat([member.T @ z, member.sum(0)[:, None]], dim=1)          # [K, d + 1]
        if self.gather_distributed and world_size() > 1:
            stats = all_reduce_with_grad(stats)
        counts = stats[:, d:].detach()
        mean = stats[:, :d] / counts.clamp(min=1)
        moved = self.beta * groups.detach() + (1 - self.beta) * mean
        return torch.where(counts > 0, moved, groups.detach())

    def forward(self, prediction: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the prediction's logits against the groups G' (`grouped`) for the `targets` (`assign`)."""
        if prediction.dim() != 2 or targets.shape != prediction.shape[:1]:
            raise ValueError(f"SMoG expects predictions [n, d] and targets [n], got {tuple(prediction.shape)} and "
                             f"{tuple(targets.shape)}")
        return F.cross_entropy(self.logits(prediction, groups), targets)
