"""MAE loss: squared error on the masked patches against per-patch normalised pixels (He et al., 2022).

An image [C, H, W] is cut into N = (H/p)(W/p) patches, row-major, each flattened to P = p*p*C
values in (row, column, channel) order (`patchify`, as the official ``patchify``). With
``norm_pix=True`` (the paper's default for its best results) every target patch is
standardised with its own mean and variance:

    t_j  = (x_j - mean(x_j)) / sqrt(var(x_j) + eps)          (unbiased variance, eps = 1e-6)
    L    = (1/n) sum_i (1/m) sum_{j in M_i} (1/P) ||pred_ij - t_ij||^2

over the n samples of the batch and the m masked patches M_i of sample i (the official
``(loss * mask).sum() / mask.sum()``, which equals this when every sample has m masked
patches, as unison's masks do).

Distributed semantics: per-sample terms only; nothing is communicated. Each rank returns
the mean over its local samples, so with equal local batches (and equal m) the mean over
ranks is the global-batch loss and DDP's gradient average is its exact gradient.

Example::

    loss_fn = MAELoss()
    target = patchify(images, patch=4).gather(1, masked[..., None].expand(-1, -1, 48))   # [n, m, 48]
    loss = loss_fn(decoder_pred_at_masked, target)
"""

from __future__ import annotations

import torch
import torch.nn as nn


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, C, H, W] -> [n, (H/p)(W/p), p*p*C], patches row-major, values in (row, column, channel) order."""
    n, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h} x {w} is not a multiple of the patch size {patch}")
    x = images.reshape(n, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(n, (h // patch) * (w // patch), patch * patch * c)


def normalize_patches(patches: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each patch (the last dimension) standardised with its own mean and unbiased variance: MAE's ``norm_pix``
    targets, which AIM predicts too."""
    return (patches - patches.mean(dim=-1, keepdim=True)) / (patches.var(dim=-1, keepdim=True) + eps).sqrt()


class MAELoss(nn.Module):
    def __init__(self, norm_pix: bool = True, eps: float = 1e-6):
        super().__init__()
        self.norm_pix, self.eps = norm_pix, eps

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """pred, target: [n, m, P] (the masked patches of each sample)."""
        if pred.shape != target.shape or pred.dim() != 3:
            raise ValueError(f"expected predictions and targets [n, m, P] of one shape, got {tuple(pred.shape)} "
                             f"and {tuple(target.shape)}")
        target = target.detach()
        if self.norm_pix:
            target = normalize_patches(target, self.eps)
        return (pred - target).pow(2).mean()
