"""KoLeo regulariser: the Kozachenko-Leonenko differential-entropy estimator (Sablayrolles et al., 2019; DINOv2).

For the L2-normalised features x_1..x_N of the global batch (DINOv2: the student's class
tokens, before the head):

    d_i = min_{j != i} ||x_i - x_j||          (nearest neighbour in the GLOBAL batch)
    L   = -(1/N) sum_i log(d_i + eps)

It spreads the features uniformly over the batch. As in DINOv2's ``KoLeoLoss`` the nearest
neighbour is found by the largest dot product (the same neighbour, for unit vectors) without
gradient, and the distance is ``||x_i - x_nn + 1e-8||`` (``nn.PairwiseDistance``), eps = 1e-8.

Distributed semantics (``gather_distributed=True``): DINOv2 searches the neighbour within each
GPU's own batch, so its loss depends on the number of GPUs. Here every rank gathers the
features of all ranks with `all_gather_with_grad` and searches the neighbours of its n local
features among all N; its loss is the mean over its local features. With equal local
batches the mean over ranks is L, and the gather's backward sends the gradient of every
rank's term to the owner of each neighbour, so DDP's average is L's exact gradient. With
``gather_distributed=False`` each rank searches only its local batch (DINOv2's behaviour).

Example::

    koleo = KoLeoLoss()
    loss = koleo(student_cls_tokens)        # [n, d], normalised inside
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, rank, world_size


class KoLeoLoss(nn.Module):
    def __init__(self, eps: float = 1e-8, gather_distributed: bool = True):
        super().__init__()
        self.eps = eps
        self.gather_distributed = gather_distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError(f"expected features [n, d], got {tuple(x.shape)}")
        n = x.shape[0]
        x = F.normalize(x, dim=1, eps=self.eps)
        everyone, offset = x, 0
        if self.gather_distributed and world_size() > 1:
            everyone, offset = all_gather_with_grad(x), rank() * n
        if everyone.shape[0] < 2:
            raise ValueError("KoLeo needs at least 2 samples in the batch")
        with torch.no_grad():
            dots = x @ everyone.T                                              # [n, N]
            self_idx = torch.arange(n, device=x.device) + offset
            dots[torch.arange(n, device=x.device), self_idx] = -2.0           # never one's own neighbour
            nearest = dots.argmax(dim=1)
        distance = torch.linalg.vector_norm(x - everyone[nearest] + self.eps, dim=1)
        return -torch.log(distance + self.eps).mean()
