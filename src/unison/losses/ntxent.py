"""NT-Xent (normalised temperature-scaled cross entropy), the SimCLR loss.

For a global batch of N samples with two views, z_a[i], z_b[i] L2-normalised, the 2N
anchors are every z_a[i] and z_b[i]; anchor u's positive is the other view of the same
sample and its candidates are all 2N embeddings except u itself:

    l(u) = -log( exp(<u, pos(u)>/T) / sum_{v != u} exp(<u, v>/T) )
    L    = (1 / 2N) * sum_u l(u)

Distributed semantics (``gather_distributed=True``): each rank gathers the embeddings of
all ranks with `all_gather_with_grad` and scores only its *local* 2n anchors against the
2N global candidates ([2n, 2N] logits, never [2N, 2N] on every rank). Its loss is the mean
over its local anchors; with equal local batches the mean over ranks (DDP's gradient
average) is exactly L, and the gather's backward routes every rank's gradient to the
owner of each embedding. With ``gather_distributed=False`` each rank uses only its local
negatives (a different, smaller-batch loss).

Precision: under autocast the loss runs in float32 (`in_full_precision`), as the losses built on batch
statistics do: in bf16 the similarities would be rounded before the division by T.

Example::

    loss_fn = NTXentLoss(temperature=0.5)
    loss = loss_fn(projector(backbone(view_a)), projector(backbone(view_b)))
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, rank, world_size

from ._precision import in_full_precision


class NTXentLoss(nn.Module):
    def __init__(self, temperature: float = 0.5, gather_distributed: bool = True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.gather_distributed = gather_distributed

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        if z_a.shape != z_b.shape:
            raise ValueError(f"the two views' embeddings differ in shape: {tuple(z_a.shape)} vs {tuple(z_b.shape)}")
        # float32 under autocast (module docstring): the [2n, 2N] product of small embeddings costs next to nothing
        return in_full_precision(self._loss, z_a, z_b)

    def _loss(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        n = z_a.shape[0]
        z_a = F.normalize(z_a, dim=1)
        z_b = F.normalize(z_b, dim=1)
        if self.gather_distributed and world_size() > 1:
            a_all, b_all = all_gather_with_grad(z_a), all_gather_with_grad(z_b)
            offset = rank() * n
        else:
            a_all, b_all, offset = z_a, z_b, 0
        big_n = a_all.shape[0]
        anchors = torch.cat([z_a, z_b])                       # [2n, d]   local anchors
        candidates = torch.cat([a_all, b_all])                # [2N, d]   global candidates
        logits = anchors @ candidates.T / self.temperature    # [2n, 2N]
        local = torch.arange(n, device=z_a.device) + offset   # global sample index of each local row
        self_idx = torch.cat([local, local + big_n])          # where each anchor sits among candidates
        pos_idx = torch.cat([local + big_n, local])           # its other view
        logits = logits.masked_fill(
            F.one_hot(self_idx, 2 * big_n).bool(), float("-inf"))
        return F.cross_entropy(logits, pos_idx)
