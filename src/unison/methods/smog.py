"""SMoG (Pang et al., 2022): synchronous momentum grouping, contrast at the level of groups instead of images.

    online:    z = g(f(x_a)),  p = q(z)              backbone f, projector g (BN on its output), predictor q
    momentum:  z' = g'(f'(x_b))                       EMA of (f, g), no gradient
    y  = group of z' among the K group features G     (argmax of the cosine similarity)
    G' = G moved towards the batch's z of each group  (beta = 0.99, with gradient: synchronous)
    loss = SMoGLoss: cross-entropy of cos(p, G') / tau against y;  then G <- G'
    f', g' <- m f', g' + (1 - m) f, g  (m = 0.99) after each step; every ``reset_every`` steps instead: G <- the
    k-means centres of a bank of the last ``bank_size`` online projections, and f', g' <- f, g

The two views swap roles every other step (the loss is one direction per step, as in Lightly's benchmark).

Defaults: Lightly's CIFAR-10 benchmark (the paper has no public code): 300 groups, beta 0.99, tau 0.1, momentum 0.99,
a reset every 300 steps from a bank of 10,000 projections, projector 512-2048-128 with a non-affine BN on its output
and predictor 128-2048-128 (both 2048 wide there; 512 here for CPU), SGD lr 0.01 for its batch of 512 (0.005 per 256),
momentum 0.9, weight decay 1e-6, its SMoGTransform (preset ``smog``). The k-means is scikit-learn's ``KMeans`` (one
k-means++ start, seeded by the step), as Lightly's.

Distributed semantics
---------------------
* Groups: the per-group sums and counts of the online projections are all-reduced with ``all_reduce_with_grad``
  (`unison.losses.smog`), so every rank moves the groups exactly as one process on the global batch would, and
  stores the same G' (bitwise: all-reduce results are identical on every rank). The loss is the mean over local
  images; DDP's gradient average is the exact gradient of the global-batch loss, also through G'.
* The bank is shared by all workers: each rank enqueues the gathered global batch (``gather_no_grad``, in the global
  sample order), so the banks are identical on every rank; the k-means runs on rank 0 and its centres are
  broadcast, so every rank resets to the same groups.
* Groups, bank, its write position, the momentum network and the step counter are rank-local state (never broadcast
  by DDP), persistent (saved in checkpoints); rank 0's are copied to every rank once, on the first forward.

Exact with gather on and SyncBN. With gather off each rank moves its own copy of the groups (they drift apart).

Example::

    backbone, dim = build_backbone("resnet18")
    model = SMoG(backbone, dim, SMoGParams(), steps_total=10_000)
    loss = model([view_a, view_b]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import broadcast_, gather_no_grad, micro_major, rank, world_size
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import SMoGLoss
from unison.models import mlp

from ._common import broadcast_once, check_global_views, two_views
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class SMoGParams:
    proj_hidden_dim: int = 512      # Lightly CIFAR-10: 2048 (reduced for CPU)
    proj_dim: int = 128
    pred_hidden_dim: int = 512      # Lightly CIFAR-10: 2048 (reduced for CPU)
    n_groups: int = 300             # K
    beta: float = 0.99              # momentum of the group features
    temperature: float = 0.1
    momentum: float = 0.99          # momentum network EMA
    reset_every: int = 300          # steps between k-means resets of the groups (0: never)
    bank_size: int = 10_000         # online projections kept for the k-means

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "pred_hidden_dim", "bank_size"),
                     classes=("n_groups",), counts=("reset_every",), temperatures=("temperature",),
                     unit_interval=("beta", "momentum"))
        if self.reset_every and self.bank_size < self.n_groups:
            raise ConfigError(f"SMoG parameter bank_size={self.bank_size} is smaller than n_groups={self.n_groups}: "
                              f"the k-means of a reset needs at least as many projections as groups; give --param "
                              f"bank_size={max(self.n_groups, 10_000)} or fewer groups")


def bank_size_check(params: SMoGParams, global_batch: int) -> None:
    """`ConfigError` unless one step's projections fit in the bank."""
    if params.reset_every and params.bank_size < global_batch:
        raise ConfigError(f"SMoG parameter bank_size={params.bank_size} is smaller than the global batch "
                          f"{global_batch}: one step's projections would overwrite each other; give --param "
                          f"bank_size={max(global_batch, 10_000)} or more")


class SMoG(SSLMethod):
    name = "smog"
    Params = SMoGParams
    # Embedded default (150 steps): the SGD recipe stays below random-init accuracy there, Adam moves it
    # (docs/benchmarks.md), as for BYOL.
    recipe = Recipe(optimizer="sgd", base_lr=0.01 / 2, weight_decay=1e-6, augmentation="smog",
                    embedded={"optimizer": "adam", "base_lr": 2e-3, "weight_decay": 1e-6})

    groups: torch.Tensor        # buffers: group features [K, d], bank of projections [bank_size, d], its write
    bank: torch.Tensor          # position, optimiser steps taken
    bank_ptr: torch.Tensor
    step_count: torch.Tensor

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("SMoG", view_sizes, exactly=2, presets="smog, byol or simclr")

    def __init__(self, backbone: nn.Module, feature_dim: int, params: SMoGParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2, last_batch_norm=True,
                             last_bn_affine=False)
        self.predictor = mlp(params.proj_dim, params.pred_hidden_dim, params.proj_dim, 2)
        self.target = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("groups", F.normalize(torch.rand(params.n_groups, params.proj_dim), dim=1))
        self.register_buffer("bank", F.normalize(torch.randn(params.bank_size if params.reset_every else 1,
                                                             params.proj_dim), dim=1))
        self.register_buffer("bank_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["groups", "bank", "bank_ptr", "step_count"])
        self.loss_fn = SMoGLoss(params.temperature, params.beta, gather_distributed=self.gather_distributed)

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        bank_size_check(params, global_batch)

    def _sync_once(self) -> None:
        self.target.sync_once()
        broadcast_once(self, lambda: [self.groups, self.bank, self.bank_ptr])

    @torch.no_grad()
    def _enqueue(self, z: torch.Tensor) -> None:
        if self.gather_distributed:
            z = micro_major(gather_no_grad(z))                      # the global batch, in the global sample order
        m, size = z.shape[0], self.bank.shape[0]
        rows = (self.bank_ptr + torch.arange(m, device=z.device)) % size
        self.bank[rows] = z.to(self.bank.dtype)
        self.bank_ptr.copy_((self.bank_ptr + m) % size)

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "SMoG")
        if self.params.reset_every:
            bank_size_check(self.params, a.shape[0] * (world_size() if self.gather_distributed else 1))
        self._sync_once()
        if int(self.step_count) % 2:                                  # the views swap roles every other step
            a, b = b, a
        z = self.projector(self.backbone(a))
        p = self.predictor(z)
        with torch.no_grad():
            targets = self.loss_fn.assign(self.target.projector(self.target.backbone(b)), self.groups)
        moved = self.loss_fn.grouped(z, self.groups)
        loss = self.loss_fn(p, targets, moved)
        if self.training:
            self.groups.copy_(moved.detach())
            if self.params.reset_every:
                self._enqueue(z.detach())
        return loss

    @torch.no_grad()
    def reset_groups(self, step: int) -> None:
        """The groups <- the normalised k-means centres of the bank (computed on rank 0, broadcast to every rank)."""
        if rank() == 0:
            from sklearn.cluster import KMeans  # scikit-learn: imported only when a reset runs

            bank = self.bank.detach().double().cpu().numpy()
            centres = KMeans(self.params.n_groups, n_init=1, random_state=step).fit(bank).cluster_centers_
            self.groups.copy_(F.normalize(torch.from_numpy(centres), dim=1).to(self.groups))
        broadcast_(self.groups)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        if self.params.reset_every and (step + 1) % self.params.reset_every == 0:
            self.reset_groups(step)
            self.target.update(self, 0.0)                             # the momentum network <- the online one
            for name, copy in self.target.named_children():
                for mine, theirs in zip(copy.buffers(), getattr(self, name).buffers()):
                    mine.copy_(theirs)                                # with its running statistics
        else:
            self.target.update(self, self.params.momentum)
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: each rank moves its own group features towards its local batch"
        return None

