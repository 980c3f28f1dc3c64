"""I-JEPA loss: the predictor's patch embeddings against the target encoder's (Assran et al., 2023).

For sample i, target block b (M of them) and patch j of the block (K patches each), the
predictor output s_hat and the target encoder's layer-normalised patch embedding s (no
gradient), each of dimension D:

    L = (1/n) sum_i (1/M) sum_b (1/K) sum_{j in B_b} ||s_hat_ibj - s_ibj||_2^2

This is the paper's objective (its Eq. 1: mean over blocks of the summed squared L2 distance
over the block's patches), divided by the fixed block size K so that the scale does not
depend on the block size. The official code uses ``F.smooth_l1_loss`` (a Huber loss, averaged
over every element); we follow the paper's L2, as its text and ablations state it.

Distributed semantics: per-sample terms only; nothing is communicated. With equal local
batches the mean over ranks is the global-batch loss and DDP's average is its exact gradient.

Example::

    loss_fn = IJEPALoss()
    loss = loss_fn(predicted, targets)        # [n, M, K, D] each
"""

from __future__ import annotations

import torch
import torch.nn as nn


class IJEPALoss(nn.Module):
    def forward(self, predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if predicted.shape != target.shape or predicted.dim() != 4:
            raise ValueError(f"expected predictions and targets [n, M, K, D] of one shape, got "
                             f"{tuple(predicted.shape)} and {tuple(target.shape)}")
        return (predicted - target.detach()).pow(2).sum(dim=-1).mean()
