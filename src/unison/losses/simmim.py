"""SimMIM loss (Xie et al., 2022): L1 between the predicted and the raw pixels of the masked patches.

The encoder sees every patch, the masked ones replaced by a learned mask token; a linear head maps each output
patch token to the p*p*3 pixels of its patch (`patchify` order). Over the n samples of the batch and the m
masked patches M_i of sample i, P = p*p*3 values each:

    L = (1/n) sum_i (1/(m P)) sum_{j in M_i} || pred_ij - x_ij ||_1

against the input pixels themselves (normalised as the encoder sees them; SimMIM has no per-patch
normalisation). The official code divides the summed pixel errors by the batch's count of masked pixels
(``(loss * mask).sum() / (mask.sum() + 1e-5) / in_chans``); with the same m for every sample, as unison's
masks have, that is this mean (without the 1e-5, as every sample masks at least one patch).

Distributed semantics: per-sample terms only; nothing is communicated. Each rank returns the mean over its
local samples, so with equal local batches the mean over ranks is the global-batch loss and DDP's gradient
average is its exact gradient.

Example::

    loss_fn = SimMIMLoss()
    target = patchify(images, patch=4).gather(1, masked[..., None].expand(-1, -1, 48))   # [n, m, 48]
    loss = loss_fn(head(tokens_at_masked), target)
"""

from __future__ import annotations

import torch
import torch.nn as nn


class SimMIMLoss(nn.Module):
    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """pred, target: [n, m, P] (the masked patches of each sample)."""
        if pred.shape != target.shape or pred.dim() != 3:
            raise ValueError(f"expected predictions and targets [n, m, P] of one shape, got {tuple(pred.shape)} "
                             f"and {tuple(target.shape)}")
        return (pred - target.detach()).abs().mean()
