"""SimSiam loss: symmetrised negative cosine similarity with stop-gradient on the targets.

With D(p, z) = -cos(p, stopgrad(z)) per sample, predictions p and projections z of the
two views a, b:

    L = (1/n) * sum_i [ D(p_a_i, z_b_i) + D(p_b_i, z_a_i) ] / 2            (-1 <= L <= 1)

The stop-gradient (``z.detach()``) is part of the loss: gradients reach the encoder only
through the predictions.

Distributed semantics: per-sample terms only, nothing to communicate; each rank returns
the mean over its local samples, so DDP's gradient average is exactly the gradient of the
global-batch mean (batch norm coupling is global with SyncBN).

Example::

    loss_fn = SimSiamLoss()
    loss = loss_fn(p_a, p_b, z_a, z_b)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SimSiamLoss(nn.Module):
    def forward(self, p_a: torch.Tensor, p_b: torch.Tensor, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        if not (p_a.shape == p_b.shape == z_a.shape == z_b.shape):
            raise ValueError(f"predictions and projections must share one shape, got {tuple(p_a.shape)}, "
                             f"{tuple(p_b.shape)}, {tuple(z_a.shape)}, {tuple(z_b.shape)}")
        d_ab = -F.cosine_similarity(p_a, z_b.detach(), dim=1).mean()
        d_ba = -F.cosine_similarity(p_b, z_a.detach(), dim=1).mean()
        return 0.5 * (d_ab + d_ba)

