"""FastSiam loss (Pototzky et al., 2022): SimSiam over K views, each prediction against the mean of the others.

With predictions p_v and projections z_v of the K views v of a sample (K = 4 in the paper) and
D(p, t) = -cos(p, stopgrad(t)):

    t_v = (1 / (K - 1)) sum_{u != v} z_u          the target of view v: the other views' mean projection
    L   = (1/n) sum_i (1/K) sum_v D(p_v[i], t_v[i])                          (-1 <= L <= 1)

Averaging K - 1 projections gives each prediction a steadier target than SimSiam's single other view, which is
what lets the paper train in fewer epochs on one GPU. With K = 2 it is `unison.losses.simsiam.SimSiamLoss`.
The stop-gradient (``detach``) is part of the loss: gradients reach the encoder only through the predictions.

Distributed semantics: per-sample terms only, nothing to communicate; each rank returns the mean over its local
samples, so DDP's gradient average is exactly the gradient of the global-batch mean (batch norm coupling is
global with SyncBN).

Example::

    loss_fn = FastSiamLoss()
    loss = loss_fn([p_1, p_2, p_3, p_4], [z_1, z_2, z_3, z_4])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class FastSiamLoss(nn.Module):
    def forward(self, predictions: Sequence[torch.Tensor], projections: Sequence[torch.Tensor]) -> torch.Tensor:
        k = len(predictions)
        if k < 2 or len(projections) != k:
            raise ValueError(f"FastSiam needs as many predictions as projections, at least 2 views; got {k} "
                             f"predictions and {len(projections)} projections")
        shape = predictions[0].shape
        if any(t.shape != shape for t in (*predictions, *projections)):
            raise ValueError("predictions and projections must share one shape, got "
                             f"{[tuple(t.shape) for t in (*predictions, *projections)]}")
        z = torch.stack([t.detach() for t in projections])            # [K, n, d], the stop-gradient
        terms = [-F.cosine_similarity(p, z[[u for u in range(k) if u != v]].mean(dim=0), dim=1).mean()
                 for v, p in enumerate(predictions)]                    # against t_v, the other views' mean
        return torch.stack(terms).mean()
