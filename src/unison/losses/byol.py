"""BYOL loss: normalised mean squared error between online predictions and target projections.

For online predictions p and target projections z' (no gradient), per sample

    l(p, z') = || p/|p| - z'/|z'| ||^2 = 2 - 2 cos(p, z')

symmetrised over the two views (view a's prediction against view b's target and vice
versa) and averaged over the two directions and the local samples:

    L = (1/n) * sum_i [ l(p_a_i, z'_b_i) + l(p_b_i, z'_a_i) ] / 2          (0 <= L <= 4)

(The paper sums the two directions; averaging halves the gradient, which the recipe's
learning rate accounts for.)

Distributed semantics: no cross-sample term, nothing to communicate. Each rank returns
the mean over its local samples, so DDP's gradient average is exactly the gradient of the
global-batch mean; the only coupling between samples is batch norm in the networks,
global with SyncBN.

Example::

    loss_fn = BYOLLoss()
    loss = loss_fn(p_a, p_b, z_a_target, z_b_target)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _normalised_mse(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return 2 - 2 * F.cosine_similarity(p, z.detach(), dim=1)


class BYOLLoss(nn.Module):
    def forward(self, p_a: torch.Tensor, p_b: torch.Tensor, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        if not (p_a.shape == p_b.shape == z_a.shape == z_b.shape):
            raise ValueError(f"predictions and targets must share one shape, got {tuple(p_a.shape)}, "
                             f"{tuple(p_b.shape)}, {tuple(z_a.shape)}, {tuple(z_b.shape)}")
        return 0.5 * (_normalised_mse(p_a, z_b).mean() + _normalised_mse(p_b, z_a).mean())
