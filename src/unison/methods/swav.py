"""SwAV (Caron et al., 2020): swapped prediction of online cluster assignments, with multi-crop.

    z   = normalize(g(f(x)))                   backbone f (one pass per crop resolution), projector g
    s_v = z_v C^T                              scores against K L2-normalised prototypes C
    q_i = SinkhornKnopp(s_i)                   codes of the 2 global crops (no gradient)
    loss = SwAVLoss: every other crop predicts q_i with softmax(s_v / T)

Prototypes: an ``nn.Linear(d, K, bias=False)`` whose rows are L2-normalised *in place at the
start of every forward* (official SwAV normalises them at the start of every iteration),
so the optimiser updates unnormalised weights and the next forward projects them back to
the sphere. ``freeze_prototypes_steps`` = N: for the first N steps the prototypes get a
zero gradient and are restored after the optimiser step (official SwAV drops their
gradient), so they stay fixed; the momentum / Adam state still sees the zero gradients.

Views: 2 global crops first, then any number of local crops (smaller); only the global
crops are assigned codes.

Defaults: CIFAR-10 settings of Lightly's benchmark: projector 512-512-128, 512 prototypes,
T = 0.1, Sinkhorn eps = 0.05 with 3 iterations, Adam, lr 1e-3 per 128 images (2e-3 per
256), weight decay 1e-6; multi-crop augmentations. solo-learn: 3000 prototypes, a 3840
queue from epoch 50, prototypes frozen for 2 epochs. No queue and no freezing by default
(short runs).

Queue (``queue_length`` = Q > 0, the global number of stored embeddings per global crop):
the detached embeddings of past batches are scored against the current prototypes and
prepended to Sinkhorn's columns from step ``queue_start_step`` on, once the queue is full.
Q must be a multiple of the global batch (checked with a one-line error).

Distributed semantics
---------------------
* Sinkhorn all-reduces its total and row sums and uses the global column count, so each
  rank's codes are the columns of the single-process codes (see `unison.losses.swav`); the
  loss is the mean over local samples: exact with gather on and SyncBN.
* ``shared_queue=True`` (default): each rank enqueues the gathered global batch
  (``gather_no_grad``), so the queues are identical [2, Q, d] on every rank (and saved in
  full by any rank's checkpoint); rank r feeds Sinkhorn its slice r of the Q rows, so all
  ranks together contribute each stored row exactly once: exact.
* ``shared_queue=False``: each rank enqueues its own embeddings and feeds Sinkhorn its newest
  Q / W rows (official SwAV). Together these are the same Q rows as one process, so a run
  is still exact; but a checkpoint written by one rank holds only that rank's rows, so a
  resumed run starts every rank from the same rows (duplicates) until the queue refills.
* ``--shard full``: the prototypes stay in the method's own FSDP unit (gathered for its forward);
  they are re-normalised after every optimiser step too, on the stored rows, since the forward's
  in-place normalisation only reaches the gathered copy.
* The queue, its fill counter and the step counter are rank-local state (DDP never
  broadcasts them) and persistent (saved in checkpoints).

Example::

    backbone, dim = build_backbone("resnet18")
    model = SwAV(backbone, dim, SwAVParams(queue_length=3840))
    loss = model([global_a, global_b, *local_crops])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import gather_no_grad, local_slice, micro_major, world_size
from unison.distributed.dtensor import assign_full_, local_view
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import SwAVLoss
from unison.models import mlp

from ._common import TWO_VIEWS_UP_TO_PX, check_multicrop, multicrop_features
from .base import Recipe, SSLMethod
from .params import check_params


@dataclass
class SwAVParams:
    proj_hidden_dim: int = 512
    proj_dim: int = 128
    n_prototypes: int = 512             # Lightly CIFAR-10 (solo-learn: 3000)
    temperature: float = 0.1
    sinkhorn_epsilon: float = 0.05
    sinkhorn_iterations: int = 3
    sinkhorn_float64: bool = False
    queue_length: int = 0               # global queue length Q per global crop; 0 = no queue
    queue_start_step: int = 0
    freeze_prototypes_steps: int = 0

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "sinkhorn_iterations"), classes=("n_prototypes",),
                     counts=("queue_length", "queue_start_step", "freeze_prototypes_steps"),
                     temperatures=("temperature",), sinkhorn=("sinkhorn_epsilon",))


def queue_length_check(params: SwAVParams, n_local: int, w: int) -> None:
    """`ConfigError` unless the queue holds a whole number of global batches."""
    q, g = params.queue_length, n_local * w
    if q % g:
        raise ConfigError(
            f"SwAV queue_length={q} is not a multiple of the global batch {g} ({n_local} per rank x {w} ranks); "
            f"use queue_length={max(g, round(q / g) * g)} (any multiple of {g})")


class SwAV(SSLMethod):
    name = "swav"
    unsharded_children = ("prototypes",)   # forward reads prototypes.weight itself
    Params = SwAVParams
    recipe = Recipe(optimizer="adam", base_lr=1e-3 * 2, weight_decay=1e-6, augmentation="multicrop",
                    global_views_up_to=TWO_VIEWS_UP_TO_PX)

    step_count: torch.Tensor   # buffers: optimiser steps taken; queue [2, Q, d] and rows filled (queue_length > 0)
    queue: torch.Tensor
    queue_filled: torch.Tensor

    def __init__(self, backbone: nn.Module, feature_dim: int, params: SwAVParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.prototypes = nn.Linear(params.proj_dim, params.n_prototypes, bias=False)
        self._normalize_prototypes()
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        local_state = ["step_count"]
        if params.queue_length:
            self.register_buffer("queue", torch.zeros(2, params.queue_length, params.proj_dim))
            self.register_buffer("queue_filled", torch.zeros((), dtype=torch.long))
            local_state += ["queue", "queue_filled"]
        mark_rank_local_state(self, local_state)
        self.loss_fn = SwAVLoss(params.temperature, params.sinkhorn_epsilon, params.sinkhorn_iterations,
                                gather_distributed=self.gather_distributed, float64=params.sinkhorn_float64)
        self._frozen_weight: torch.Tensor | None = None

    def _apply(self, fn, *args, **kwargs):
        # After a dtype/device change (.to(float64)), normalise in the new precision, so the stored rows are
        # unit vectors to that precision before the first forward (which under --shard full normalises only
        # the gathered copy of the prototypes).
        out = super()._apply(fn, *args, **kwargs)
        self._normalize_prototypes()
        return out

    @torch.no_grad()
    def _normalize_prototypes(self) -> None:
        # Rows are normalised one by one, and FSDP shards whole rows (dim 0): the local slice suffices.
        w = local_view(self.prototypes.weight)
        w.copy_(F.normalize(w, dim=1))

    # ------------------------------------------------------------------ queue
    def _check_queue(self, n_local: int) -> None:
        queue_length_check(self.params, n_local, world_size())

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        if params.queue_length:
            queue_length_check(params, global_batch // world_size, world_size)

    def _queue_rows_used(self) -> int:
        return self.params.queue_length if self.shared_queue else self.params.queue_length // world_size()

    def _queue_in_use(self) -> bool:
        return (int(self.step_count) >= self.params.queue_start_step
                and int(self.queue_filled) >= self._queue_rows_used())

    def _queue_rows(self) -> torch.Tensor:
        q = self.params.queue_length
        rows = local_slice(q) if self.shared_queue else slice(0, q // world_size())
        return self.queue[:, rows]                                      # [2, Q / W, d]

    @torch.no_grad()
    def _enqueue(self, z_assign: torch.Tensor) -> None:
        n, d = z_assign.shape[1], z_assign.shape[2]                      # z_assign: [2, n, d]
        new = z_assign
        if self.shared_queue:
            new = micro_major(gather_no_grad(z_assign.transpose(0, 1).reshape(n, 2 * d)))   # one collective, [N, 2d]
            new = new.reshape(-1, 2, d).transpose(0, 1)                  # [2, N, d], the global sample order
        m = new.shape[1]
        self.queue[:, m:] = self.queue[:, :-m].clone()
        self.queue[:, :m] = new.to(self.queue.dtype)
        self.queue_filled.fill_(min(int(self.queue_filled) + m, self.params.queue_length))

    # ------------------------------------------------------------------ interface
    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        n = check_multicrop(views, "SwAV")
        if self.params.queue_length:
            self._check_queue(n)
        self._normalize_prototypes()
        z = F.normalize(self.projector(multicrop_features(self.backbone, views)), dim=1)
        w = self.prototypes.weight
        if int(self.step_count) < self.params.freeze_prototypes_steps:
            if self.training:
                self._frozen_weight = w.detach().clone()
            w = w.detach() + 0.0 * w                   # used (DDP sees a gradient), but the gradient is zero
        scores = list(F.linear(z, w).split(n))
        queue_scores = None
        if self.params.queue_length and self._queue_in_use():
            rows = self._queue_rows()
            queue_scores = [F.linear(rows[i], w.detach()) for i in range(2)]
        loss = self.loss_fn(scores, queue_scores)
        if self.training and self.params.queue_length:
            self._enqueue(z[: 2 * n].detach().reshape(2, n, -1))
        return loss

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        if self._frozen_weight is not None:
            assign_full_(self.prototypes.weight, self._frozen_weight)
            self._frozen_weight = None
        # Also here, not only at the start of the forward: under --shard full the forward normalises the
        # gathered copy, which is discarded, while the optimizer updates the stored shards.
        self._normalize_prototypes()
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        note = super().exactness_note()
        if note is None and self.params.queue_length and not self.shared_queue:
            note = ("shared_queue is off: per-rank SwAV queues are exact within a run, but a run resumed from one "
                    "rank's checkpoint restarts every rank from that rank's rows until the queue refills")
        return note
