"""NNCLR (Dwibedi et al., 2021): contrastive learning whose positive is the nearest neighbour in a support set.

    z = g(f(x))                       backbone f, projector g (batch norm after every layer, the last one too)
    p = h(z)                          predictor h: 2 layers, the hidden one with batch norm
    q = NN(z, Q) = argmax_{s in Q} cos(z, s)          the support set Q: a FIFO queue of past z (no gradient)
    loss = (NNCLRLoss(q_a, p_b) + NNCLRLoss(q_b, p_a)) / 2     InfoNCE of q_i against the other view's predictions
    Q <- enqueue(normalize(z_a))      after the step's lookups: the projections of the first view

Each view runs through the networks in its own forward pass (as Lightly's and solo-learn's NNCLR). The
neighbours carry no gradient: the encoder learns through the predictions. The symmetric term of the paper
(sect. 3.2, each prediction also contrasted against every neighbour) is on by default (``symmetric``); the
queue holds one view's projections per sample, as the authors' implementation (VISSL's and Keras' ports, Lightly,
solo-learn all enqueue one view). The queue starts as random unit vectors, as the paper's.

Defaults: the paper's predictor; the temperature, projector and support set of Lightly's CIFAR-10 benchmark:
temperature 0.5 (its NT-Xent's; the paper's 0.1 is ImageNet's, and at CIFAR scale it learns markedly less: the
measurement is in docs/benchmarks.md), 2 projector layers (the paper's 3 are for ImageNet), a 4096-entry support
set (the paper, ImageNet: 98304); widths reduced for CPU from
2048 / 256 / 4096 to 1024 / 256 / 1024 (pass ``proj_hidden_dim=2048, pred_hidden_dim=4096`` for the paper's).
Recipe: Lightly's CIFAR-10 benchmark, SGD, lr 0.06 per 128 images (0.12 per 256), weight decay 5e-4, SimCLR's
augmentations (the paper's).

Distributed semantics
---------------------
* ``shared_queue=True`` (default): the first view's projections of every rank are gathered without gradient
  (`gather_no_grad`, in the global sample order) and the same global batch is enqueued on every rank, so the
  queues stay identical: a sample's nearest neighbour is looked up in the same support set whatever rank it lands
  on, and is the one of one process on the global batch. Needs queue_size % global batch == 0 (checked before any
  worker starts, with a one-line error naming the sizes that work).
* The loss (`unison.losses.nnclr`) gathers the predictions with gradient and the neighbours without: each rank's
  loss is its share of the global-batch loss, and DDP's gradient average is its exact gradient. With SyncBN
  (batch norm in both heads) the whole step is exact.
* Under exact gradient accumulation the forward sees all K micro-batches of a step: K x the global batch is
  looked up in the queue as it was before the step and then enqueued, as one big batch would be.
* ``shared_queue=False``: each rank enqueues only its own projections (per-rank support sets, no communication);
  a sample's neighbour then depends on the rank it lands on: not equivalent to one process.
* The queue and its pointer are persistent buffers (saved in checkpoints: a resumed run continues with the same
  support set) marked rank-local, so DDP never re-broadcasts them; rank 0's queue is copied to every rank once,
  on the first forward.

Example::

    backbone, dim = build_backbone("resnet18")
    model = NNCLR(backbone, dim, NNCLRParams())
    loss = model([view_a, view_b]); loss.backward(); opt.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import gather_no_grad, micro_major, world_size
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import NNCLRLoss, nearest_neighbours
from unison.models import mlp

from ._common import broadcast_once, check_global_views, two_views
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class NNCLRParams:
    temperature: float = 0.5        # Lightly CIFAR-10 benchmark (paper, ImageNet: 0.1)
    queue_size: int = 4096          # support set; Lightly CIFAR-10 benchmark (paper, ImageNet: 98304)
    proj_hidden_dim: int = 1024     # paper: 2048 (reduced for CPU)
    proj_dim: int = 256             # d, paper
    proj_layers: int = 2            # Lightly CIFAR-10 benchmark (paper, ImageNet: 3)
    pred_hidden_dim: int = 1024     # paper: 4096 (reduced for CPU)
    symmetric: bool = True          # the paper's symmetric term (sect. 3.2)

    def __post_init__(self) -> None:
        check_params(self, sizes=("queue_size", "proj_hidden_dim", "proj_dim", "proj_layers", "pred_hidden_dim"),
                     temperatures=("temperature",))


def queue_size_check(params: NNCLRParams, n_local: int, w: int, shared_queue: bool) -> None:
    """`ConfigError` unless the support set holds a whole number of steps' projections (global when shared)."""
    k, m = params.queue_size, n_local * (w if shared_queue else 1)
    if k % m == 0:
        return
    batch = (f"the global batch {m} = {n_local} per rank x {w} ranks" if shared_queue
             else f"the local batch {m} (per-rank queue)")
    raise ConfigError(f"NNCLR queue_size={k} is not a multiple of {batch}, the projections enqueued per step; "
                      f"use queue_size={max(m, round(k / m) * m)} (any multiple of {m}) or a batch size that divides "
                      f"{k}")


class NNCLR(SSLMethod):
    name = "nnclr"
    Params = NNCLRParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="simclr")

    queue: torch.Tensor        # buffers: the support set [K, d] (L2-normalised rows) and the next write position
    queue_ptr: torch.Tensor

    def __init__(self, backbone: nn.Module, feature_dim: int, params: NNCLRParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, params.proj_layers,
                             last_batch_norm=True)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2)
        self.register_buffer("queue", F.normalize(torch.randn(params.queue_size, params.proj_dim), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["queue", "queue_ptr"])
        self.loss_fn = NNCLRLoss(params.temperature, params.symmetric, gather_distributed=self.gather_distributed)

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        queue_size_check(params, global_batch // world_size, world_size, shared_queue)

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("NNCLR", view_sizes, exactly=2)

    @torch.no_grad()
    def _enqueue(self, z: torch.Tensor) -> None:
        if self.shared_queue:
            z = micro_major(gather_no_grad(z))           # [N, d] in the global sample order
        ptr, m = int(self.queue_ptr), z.shape[0]
        self.queue[ptr:ptr + m] = z.to(self.queue.dtype)
        self.queue_ptr.fill_((ptr + m) % self.params.queue_size)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "NNCLR")
        queue_size_check(self.params, a.shape[0], world_size(), self.shared_queue)
        if self.shared_queue:
            broadcast_once(self, lambda: [self.queue, self.queue_ptr])
        z_a = self.projector(self.backbone(a))
        z_b = self.projector(self.backbone(b))
        q_a = nearest_neighbours(z_a, self.queue)        # both against the support set before this step's enqueue
        q_b = nearest_neighbours(z_b, self.queue)
        loss = 0.5 * (self.loss_fn(q_a, self.predictor(z_b)) + self.loss_fn(q_b, self.predictor(z_a)))
        if self.training:
            self._enqueue(F.normalize(z_a.detach(), dim=1))
        return loss

    def exactness_note(self) -> str | None:
        note = super().exactness_note()
        if note is None and not self.shared_queue:
            note = "shared_queue is off: each rank looks up nearest neighbours in its own support set"
        return note
