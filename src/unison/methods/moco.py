"""MoCo v2 (Chen et al., 2020): a query encoder, a momentum key encoder and a queue of negatives.

    q = normalize(g(f(x_a)))                     query encoder f + 2-layer MLP g (trained)
    k = normalize(g'(f'(x_b)))                   key encoder: EMA of (f, g), no gradient
    loss = MoCoLoss(q, k, queue; T)              InfoNCE: positive k, negatives = queue
    f', g' <- m f', g' + (1 - m) f, g            after every optimiser step (m = 0.99)
    queue <- enqueue(k)                          FIFO of the last K keys

Symmetrised (``symmetric=True``, default): both views serve as queries,
loss = (MoCoLoss(q_a, k_b) + MoCoLoss(q_b, k_a)) / 2, both against the queue as it was
before this step, then the keys of both views are enqueued (the official CIFAR-10 demo
notebook and Lightly's benchmark do the same).

Defaults: CIFAR-10 settings of the official MoCo CIFAR-10 demo and Lightly's benchmark:
T = 0.1, K = 4096, m = 0.99, projector 512-512-128 without batch norm (MoCo v2's head),
SGD, lr 0.06 per 128 images (0.12 per 256), weight decay 5e-4, SimCLR's colour augmentations with crops from
20 % of the image (MoCo v2's, preset ``mocov2``).
solo-learn's MoCo v2+ uses T = 0.2 with a 32768 queue; pass ``temperature=0.2`` for that.

Distributed semantics
---------------------
* Loss: no gather needed; each rank's loss is the mean over its local queries.
* ``shared_queue=True`` (default): the keys of every rank are gathered *without gradient*
  (`gather_no_grad`, one collective for both views) and the same global batch of keys is
  enqueued on every rank, so the queues stay identical and every query sees the same
  negatives as in one process on the global batch: exact (with SyncBN, which also makes
  the key encoder's batch statistics global). Needs queue_size % keys_per_step == 0,
  keys_per_step = (2 if symmetric else 1) * global batch; checked at every step with a
  one-line error naming the sizes that work.
* ``shared_queue=False``: each rank enqueues only its own keys (per-rank queues, no
  communication); each rank's queries see a different set of negatives: not equivalent
  to one process.
* The key encoder (a `MomentumTeacher`), queue, pointer and step counter are marked
  rank-local state, so DDP never broadcasts them (a broadcast would replace per-rank queues
  by rank 0's). They are persistent buffers/parameters, so they are saved in ``state_dict()`` checkpoints. On the
  first forward, rank 0's key encoder (and shared queue) are copied to all ranks once.
* ``shuffle_bn=True``: MoCo's shuffle BN. The key inputs of all ranks are gathered, permuted
  with a permutation that is the same on every rank (seeded by ``shuffle_seed``, the step
  and the view), each rank encodes its slice of the permuted batch with *per-rank* batch
  norm (the key encoder's synchronised BN layers are replaced by local ones), and the keys
  are gathered and un-permuted. This hides the positive pair from the key encoder's batch
  statistics without SyncBN; the keys depend on how the batch is split, so it is not
  equivalent to one process.

Example::

    backbone, dim = build_backbone("resnet18")
    model = MoCo(backbone, dim, MoCoParams(), steps_total=10_000)
    loss = model([view_a, view_b]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import gather_no_grad, local_slice, micro_major, world_size
from unison.distributed.sync_batchnorm import GlobalBatchNorm
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import MoCoLoss
from unison.models import mlp

from ._common import broadcast_once, two_views
from .base import Recipe, SSLMethod
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class MoCoParams:
    temperature: float = 0.1        # official MoCo CIFAR-10 demo, Lightly benchmark (MoCo v2 ImageNet: 0.2)
    queue_size: int = 4096          # K, number of negative keys (multiple of the keys enqueued per step)
    momentum: float = 0.99          # key encoder EMA (CIFAR; 0.999 on ImageNet)
    proj_hidden_dim: int = 512
    proj_dim: int = 128
    symmetric: bool = True          # both views as queries, loss averaged
    shuffle_bn: bool = False        # shuffle BN for the key encoder (per-rank BN; not exact)
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        check_params(self, sizes=("queue_size", "proj_hidden_dim", "proj_dim"), counts=("shuffle_seed",), temperatures=("temperature",),
                     unit_interval=("momentum",))


class _LocalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Plain batch norm over this rank's batch, any input of rank >= 2 (shuffle BN's key encoder)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"batch norm expects at least 2-D input (N, C, ...), got {input.dim()}-D")


def localize_batchnorm(module: nn.Module) -> None:
    """Replace synchronised batch-norm layers under `module` by per-rank ones (same state)."""
    for name, child in module.named_children():
        if isinstance(child, (GlobalBatchNorm, nn.SyncBatchNorm)):
            p = child.weight if child.affine else child.running_mean
            local = _LocalBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                    child.track_running_stats, device=p.device if p is not None else None,
                                    dtype=p.dtype if p is not None else None)
            local.load_state_dict(child.state_dict())
            for q in local.parameters():
                q.requires_grad_(False)
            local.train(child.training)
            setattr(module, name, local)
        else:
            localize_batchnorm(child)


@torch.no_grad()
def shuffled_forward(encoder: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, seed: int) -> torch.Tensor:
    """encoder(x) computed on a permutation of the global batch (shuffle BN), returned in x's order.

    Gathers x from every rank, permutes it with a permutation drawn from `seed` (identical
    on all ranks), encodes this rank's contiguous slice, gathers the outputs and undoes the
    permutation. Equal local batch sizes are assumed. In a single process it is just encoder(x).
    """
    if world_size() == 1:
        return encoder(x)
    x_all = gather_no_grad(x)
    n_all = x_all.shape[0]
    perm = torch.randperm(n_all, generator=torch.Generator().manual_seed(seed)).to(x.device)
    rows = local_slice(n_all)
    y_all = gather_no_grad(encoder(x_all[perm[rows]]))       # row j = encoding of x_all[perm[j]]
    return y_all[torch.argsort(perm)][rows]


def queue_size_check(params: MoCoParams, n_local: int, w: int, shared_queue: bool) -> None:
    """`ConfigError` unless the queue holds a whole number of steps' keys (views x batch, global when shared)."""
    k, views = params.queue_size, 2 if params.symmetric else 1
    m = views * n_local * (w if shared_queue else 1)
    if k % m == 0:
        return
    batch = (f"global batch {n_local * w} = {n_local} per rank x {w} ranks" if shared_queue
             else f"local batch {n_local} (per-rank queue)")
    suggestion = max(m, round(k / m) * m)
    raise ConfigError(
        f"MoCo queue_size={k} is not a multiple of the {m} keys enqueued per step ({views} view(s) x {batch}); "
        f"use queue_size={suggestion} (any multiple of {m}) or a batch size such that {views} x "
        f"{'global' if shared_queue else 'local'} batch divides {k}")


class MoCo(SSLMethod):
    name = "moco"
    Params = MoCoParams
    recipe = Recipe(optimizer="sgd", base_lr=0.06 * 2, weight_decay=5e-4, augmentation="mocov2")

    queue: torch.Tensor        # buffers: negative keys [K, d], next write position, optimiser steps taken
    queue_ptr: torch.Tensor
    step_count: torch.Tensor

    def __init__(self, backbone: nn.Module, feature_dim: int, params: MoCoParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2, batch_norm=False)
        self.key_encoder = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("queue", F.normalize(torch.randn(params.queue_size, params.proj_dim), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["queue", "queue_ptr", "step_count"])
        self.loss_fn = MoCoLoss(params.temperature)

    # ------------------------------------------------------------------ helpers
    def _check_queue_size(self, n_local: int) -> None:
        queue_size_check(self.params, n_local, world_size(), self.shared_queue)

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        queue_size_check(params, global_batch // world_size, world_size, shared_queue)

    def _key_encoder(self, x: torch.Tensor) -> torch.Tensor:
        return self.key_encoder.projector(self.key_encoder.backbone(x))

    @torch.no_grad()
    def _keys(self, x: torch.Tensor, view: int) -> torch.Tensor:
        if self.params.shuffle_bn and world_size() > 1:
            seed = (self.params.shuffle_seed * 1_000_003 + int(self.step_count) * 2 + view) % (2 ** 63)
            k = shuffled_forward(self._key_encoder, x, seed)
        else:
            k = self._key_encoder(x)
        return F.normalize(k, dim=1)

    @torch.no_grad()
    def _enqueue(self, keys: list[torch.Tensor]) -> None:
        d = keys[0].shape[1]
        k = torch.cat(keys, dim=1)                       # [n, views*d]: one collective for all views
        if self.shared_queue:
            k = micro_major(gather_no_grad(k))           # [N, views*d] in the global sample order
        k = torch.cat(k.split(d, dim=1))                 # [views*N, d]: view 0's keys, then view 1's
        ptr, m = int(self.queue_ptr), k.shape[0]
        self.queue[ptr:ptr + m] = k.to(self.queue.dtype)
        self.queue_ptr.fill_((ptr + m) % self.params.queue_size)

    def _sync_once(self) -> None:
        self.key_encoder.sync_once()
        if self.shared_queue:
            broadcast_once(self, lambda: [self.queue, self.queue_ptr])

    # ------------------------------------------------------------------ interface
    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "MoCo")
        self._check_queue_size(a.shape[0])
        self._sync_once()
        if self.params.shuffle_bn:
            localize_batchnorm(self.key_encoder)
        queue = self.queue.clone()                       # negatives as before this step's enqueue
        q_a = self.projector(self.backbone(a))
        k_b = self._keys(b, 1)
        if self.params.symmetric:
            q_b = self.projector(self.backbone(b))
            k_a = self._keys(a, 0)
            loss = 0.5 * (self.loss_fn(q_a, k_b, queue) + self.loss_fn(q_b, k_a, queue))
            new_keys = [k_a, k_b]
        else:
            loss = self.loss_fn(q_a, k_b, queue)
            new_keys = [k_b]
        if self.training:
            self._enqueue(new_keys)
        return loss

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.key_encoder.update(self, self.params.momentum)
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        notes = []
        if not self.shared_queue:
            notes.append("shared_queue is off: each rank's queries see only its own queue of negatives")
        if self.params.shuffle_bn:
            notes.append("shuffle_bn: the key encoder normalises each rank's slice of a shuffled batch")
        return "; ".join(notes) or None
