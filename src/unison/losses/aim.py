"""AIM loss (El-Nouby et al., 2024): squared error of next-patch predictions on the non-prefix patches.

A sample's N patches are read in raster order; its first K patches (the prefix, K drawn per sample) attend to
each other bidirectionally and are not predicted; every later patch j >= K is predicted from the patches before
it. With each target patch standardised by its own mean and variance (`normalize_patches`, MAE's ``norm_pix``,
as the paper's best setting), P values per patch:

    e_ij = (1/P) || pred_ij - norm(x_ij) ||^2
    L    = (1/n) sum_i (1/(N - K_i)) sum_{j >= K_i} e_ij

``pred[i, j]`` is the prediction of patch j (the method shifts the encoder's outputs so that the token before
patch j predicts it). Every sample weighs the same whatever its prefix (the paper's per-image mean over its
N - K predicted patches). K_i may be 0 here (every patch a target): then L is the plain mean squared error over
all patches, which Lightly's AIM example takes (``nn.MSELoss`` on ``normalize_mean_var`` targets).

Distributed semantics: per-sample terms only (each sample's own 1/(N - K_i)); nothing is communicated. Each rank
returns the mean over its local samples, so with equal local batches the mean over ranks is the global-batch loss
and DDP's gradient average is its exact gradient.

Example::

    loss_fn = AIMLoss()
    loss = loss_fn(pred, patchify(images, patch), prefix)   # [n, N, P], [n, N, P], [n] prefix lengths
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .mae import normalize_patches


class AIMLoss(nn.Module):
    def __init__(self, norm_pix: bool = True, eps: float = 1e-6):
        super().__init__()
        self.norm_pix, self.eps = norm_pix, eps

    def forward(self, pred: torch.Tensor, patches: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """pred, patches [n, N, P]; prefix [n] integers in [0, N - 1] (patches before it are not predicted)."""
        if pred.shape != patches.shape or pred.dim() != 3 or prefix.shape != pred.shape[:1]:
            raise ValueError(f"expected predictions and patches [n, N, P] of one shape and prefix lengths [n], got "
                             f"{tuple(pred.shape)}, {tuple(patches.shape)} and {tuple(prefix.shape)}")
        n_patches = pred.shape[1]   # prefix values are not checked here: that would read the device every step
        target = patches.detach()
        if self.norm_pix:
            target = normalize_patches(target, self.eps)
        errors = (pred - target).pow(2).mean(dim=-1)                                        # [n, N]
        predicted = torch.arange(n_patches, device=pred.device) >= prefix.unsqueeze(1)      # [n, N]
        weights = predicted.to(errors.dtype) / (n_patches - prefix).unsqueeze(1).to(errors.dtype)
        return (errors * weights).sum(dim=1).mean()
