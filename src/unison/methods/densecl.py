"""DenseCL (Wang et al., 2021): MoCo v2 plus a contrastive loss between matched cells of the feature maps.

    f(x) -> pooled feature y, cells Y [S, C]      query encoder: backbone with its pooling removed (`make_dense`)
    q = g(y),  q_s = g_d(Y_s)                     global head (MoCo v2's fc-relu-fc) and dense head (the same
                                                  MLP on every cell: DenseCL's 1x1 conv-relu-conv)
    k, k_t, G_t                                   key encoder: EMA of (f, g, g_d), no gradient, on the other view
    loss = DenseCLLoss(...)                       (1 - lambda) InfoNCE(q, k; queue)
                                                  + lambda mean_s InfoNCE(q_s, k_t(s); dense queue), t(s) the key
                                                  cell whose backbone feature G_t is most cosine-similar to Y_s
    queue <- k,  dense queue <- normalize(mean_t k_t)    after the loss: FIFO of the last K keys each
    f', g', g_d' <- m f', g', g_d' + (1 - m) f, g, g_d   after every optimiser step

Maps larger than ``grid_size`` cells a side (7: ResNet-50's at 224 px, the paper's) are average-pooled to it first
(`unison.models.dense.coarse_grid`): the matching compares every cell with every cell and each cell is a query
against the whole dense queue. Any backbone with a feature map: the small CNN and ResNets, unison's ViTs (patch
tokens), timm models.

Defaults: the official code (``WXinlong/DenseCL``, ``densecl_imagenet_200ep.py``): temperature 0.2, lambda 0.5,
query view 0 and key view 1 (``symmetric=False``), heads 2 layers to 128 (their hidden width is the backbone's, 2048
for ResNet-50; 512 here, as unison's MoCo); SGD, lr 0.03 per 256 images, weight decay 1e-4; MoCo v2's augmentation
(crops from 20 %, SimCLR's colour operations: the ``mocov2`` preset). Queue length and momentum are MoCo's CIFAR-10
values, as unison's MoCo (4096, 0.99; theirs on ImageNet: 65536, 0.999: ``--param queue_size=65536 --param
momentum=0.999``). ``lambda_warmup_steps``: their ``DenseCLWarmupHook`` (lambda 0 for the first steps, which their
COCO configurations use; 0 here as in their ImageNet one). ``shuffle_bn``: their shuffle BN (not exact, as MoCo's).

Distributed semantics: as MoCo's (`unison.methods.moco`). The loss needs nothing from other ranks (a cell's positive
is a cell of its own image, its negatives the queue). With ``shared_queue=True`` (default) the keys of every rank
(global and pooled dense, both views when symmetric) are gathered without gradient in one collective and enqueued
in the global sample order on every rank, so both queues are identical everywhere and equal to one process's:
exact with SyncBN (``unison check --method densecl``). Needs queue_size % keys_per_step == 0, keys_per_step =
(2 if symmetric else 1) x global batch. The key encoder, the queues, their pointer and the step counter are
rank-local state, never broadcast by DDP, and saved in checkpoints.

Example::

    backbone, dim = build_backbone("resnet18", 32)
    model = DenseCL(backbone, dim, DenseCLParams(), steps_total=10_000)
    loss = model([view_q, view_k]); loss.backward(); opt.step(); model.on_after_step(step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import gather_no_grad, micro_major, world_size
from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import DenseCLLoss
from unison.models import mlp
from unison.models.dense import coarse_grid, dense_features, make_dense

from ._common import broadcast_once, two_views
from .base import Recipe, SSLMethod
from .moco import localize_batchnorm, shuffled_forward
from .params import check_params
from .teacher import MomentumTeacher


@dataclass
class DenseCLParams:
    temperature: float = 0.2        # official ContrastiveHead(temperature=0.2)
    loss_lambda: float = 0.5        # weight of the dense term
    lambda_warmup_steps: int = 0    # steps with lambda 0 first (their DenseCLWarmupHook; COCO: 1000)
    queue_size: int = 4096          # K of each queue (multiple of the keys enqueued per step); ImageNet: 65536
    momentum: float = 0.99          # key encoder EMA (MoCo's CIFAR-10); ImageNet: 0.999
    proj_hidden_dim: int = 512
    proj_dim: int = 128
    grid_size: int = 7              # larger feature maps average-pooled to grid_size x grid_size; 0: as they are
    symmetric: bool = False         # both views as queries, loss averaged (the official code: view 0 only)
    shuffle_bn: bool = False        # shuffle BN for the key encoder (per-rank BN; not exact)
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        check_params(self, sizes=("queue_size", "proj_hidden_dim", "proj_dim"),
                     counts=("lambda_warmup_steps", "grid_size", "shuffle_seed"), temperatures=("temperature",),
                     unit_interval=("loss_lambda", "momentum"))


def queue_size_check(params: DenseCLParams, n_local: int, w: int, shared_queue: bool) -> None:
    """`ConfigError` unless each queue holds a whole number of steps' keys (views x batch, global when shared)."""
    k, views = params.queue_size, 2 if params.symmetric else 1
    m = views * n_local * (w if shared_queue else 1)
    if k % m == 0:
        return
    batch = (f"global batch {n_local * w} = {n_local} per rank x {w} ranks" if shared_queue
             else f"local batch {n_local} (per-rank queue)")
    raise ConfigError(
        f"DenseCL queue_size={k} is not a multiple of the {m} keys enqueued per step ({views} view(s) x {batch}); "
        f"use queue_size={max(m, round(k / m) * m)} (any multiple of {m}) or a batch size such that {views} x "
        f"{'global' if shared_queue else 'local'} batch divides {k}")


class DenseCL(SSLMethod):
    name = "densecl"
    Params = DenseCLParams
    recipe = Recipe(optimizer="sgd", base_lr=0.03, weight_decay=1e-4, augmentation="mocov2")

    queue: torch.Tensor        # buffers: global and dense negative keys [K, d], next write position, steps taken
    dense_queue: torch.Tensor
    queue_ptr: torch.Tensor
    step_count: torch.Tensor

    def __init__(self, backbone: nn.Module, feature_dim: int, params: DenseCLParams, **kw):
        super().__init__(make_dense(backbone), feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2, batch_norm=False)
        self.dense_projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2, batch_norm=False)
        self.key_encoder = MomentumTeacher(backbone=self.backbone, projector=self.projector,
                                           dense_projector=self.dense_projector)
        for name in ("queue", "dense_queue"):
            self.register_buffer(name, F.normalize(torch.randn(params.queue_size, params.proj_dim), dim=1))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["queue", "dense_queue", "queue_ptr", "step_count"])
        self.loss_fn = DenseCLLoss(params.temperature, params.loss_lambda)

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        queue_size_check(params, global_batch // world_size, world_size, shared_queue)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return dense_features(self.backbone, x, self.feature_dim)[0]

    def _encode(self, backbone: nn.Module, projector: nn.Module, dense_projector: nn.Module,
                x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(global projection [n, D], dense projections [n, S, D], backbone cells [n, S, C]) of `x`."""
        pooled, grid = dense_features(backbone, x, self.feature_dim)
        cells = coarse_grid(grid, self.params.grid_size)[0].flatten(1, 2)
        return projector(pooled), dense_projector(cells), cells

    def _key_encoder(self, x: torch.Tensor) -> torch.Tensor:
        """The key encoder's three outputs of `x` in one [n, ...] tensor (what `shuffled_forward` moves)."""
        k = self.key_encoder
        out = self._encode(k.backbone, k.projector, k.dense_projector, x)
        return torch.cat([t.flatten(1) for t in out], dim=1)

    @torch.no_grad()
    def _keys(self, x: torch.Tensor, view: int, cells: int) -> tuple[torch.Tensor, ...]:
        """(k, k_dense, key cells, pooled dense key normalised) of the key view `x`; the query's `cells` tell
        the layout (the same backbone on views of one size)."""
        if self.params.shuffle_bn and world_size() > 1:
            seed = (self.params.shuffle_seed * 1_000_003 + int(self.step_count) * 2 + view) % (2 ** 63)
            flat = shuffled_forward(self._key_encoder, x, seed)
        else:
            flat = self._key_encoder(x)
        d = self.params.proj_dim
        k, k_dense, k_cells = flat.split([d, cells * d, flat.shape[1] - d - cells * d], dim=1)
        k_dense = k_dense.view(x.shape[0], cells, d)
        return (F.normalize(k, dim=1), k_dense, k_cells.reshape(x.shape[0], cells, -1),
                F.normalize(k_dense.mean(dim=1), dim=1))

    @torch.no_grad()
    def _enqueue(self, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each view's (k, pooled dense key) into the queues: view 0's keys, then view 1's (every rank the same)."""
        d = self.params.proj_dim
        k = torch.cat([torch.cat(pair, dim=1) for pair in keys], dim=1)   # [n, views * 2d]: one collective
        if self.shared_queue:
            k = micro_major(gather_no_grad(k))                             # the global sample order
        per_view = k.split(2 * d, dim=1)
        ptr, m = int(self.queue_ptr), k.shape[0] * len(keys)
        self.queue[ptr:ptr + m] = torch.cat([v[:, :d] for v in per_view]).to(self.queue.dtype)
        self.dense_queue[ptr:ptr + m] = torch.cat([v[:, d:] for v in per_view]).to(self.dense_queue.dtype)
        self.queue_ptr.fill_((ptr + m) % self.params.queue_size)

    def _sync_once(self) -> None:
        self.key_encoder.sync_once()
        if self.shared_queue:
            broadcast_once(self, lambda: [self.queue, self.dense_queue, self.queue_ptr])

    def _loss_lambda(self) -> float:
        return 0.0 if int(self.step_count) < self.params.lambda_warmup_steps else self.params.loss_lambda

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        a, b = two_views(views, "DenseCL")
        queue_size_check(self.params, a.shape[0], world_size(), self.shared_queue)
        self._sync_once()
        if self.params.shuffle_bn:
            localize_batchnorm(self.key_encoder)
        queue, dense_queue = self.queue.clone(), self.dense_queue.clone()   # negatives as before this step
        lam = self._loss_lambda() if self.params.lambda_warmup_steps else None
        directions = [(a, b, 1), (b, a, 0)] if self.params.symmetric else [(a, b, 1)]
        losses, new_keys = [], []
        for query, key, view in directions:
            q, q_dense, q_cells = self._encode(self.backbone, self.projector, self.dense_projector, query)
            k, k_dense, k_cells, k_pooled = self._keys(key, view, q_cells.shape[1])
            losses.append(self.loss_fn(q, k, queue, q_dense, k_dense, q_cells, k_cells, dense_queue, lam))
            new_keys.append((view, (k, k_pooled)))
        if self.training:
            self._enqueue([pair for _, pair in sorted(new_keys, key=lambda vk: vk[0])])
        return torch.stack(losses).mean()

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.key_encoder.update(self, self.params.momentum)
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        notes = []
        if not self.shared_queue:
            notes.append("shared_queue is off: each rank's queries see only its own queues of negatives")
        if self.params.shuffle_bn:
            notes.append("shuffle_bn: the key encoder normalises each rank's slice of a shuffled batch")
        return "; ".join(notes) or None
