"""W-MSE (Ermolov et al., 2021): whiten the embeddings of each sub-batch, then pull the views of an image together.

    z_v  = g(f(x_v))                       backbone f (one pass per view), projector g (2 layers: 1024, BN, ReLU, 64)
    groups: the global batch split at random into G = max(1, N // w_size) sub-batches of N / G (+-1) images
    loss = WMSELoss(z, groups)             Cholesky-whiten each (view, sub-batch), then 2 - 2 cos between views
                                           (`unison.losses.wmse`), averaged over w_iter random splits

Recipe: the official CIFAR-10 setting (``README.md`` "W-MSE 2", ``cfg.py``): embedding 64, head 1024 wide with
batch norm, w_size 128, w_iter 1, no shrinkage (w_eps 0), normalised MSE, Adam lr 3e-3 for its batch of 512 (1.5e-3
per 256), weight decay 1e-6, its augmentations (preset ``wmse``); ``--param n_views=4`` is its "W-MSE 4". Not
here: its 500-step warm-up and step decay of the lr (unison's warm-up and cosine instead).

Sub-batches over the global batch
---------------------------------
The paper splits each batch by ``torch.randperm`` into sub-batches of ``w_size``; per rank, that would whiten
sub-batches of one rank's images, a different loss at every world size. Here the split is of the GLOBAL batch and
a function of (seed, epoch, sample index) only: every image draws 64 random bits per split
(`unison.rng.hash64`, stream ``GROUP_STREAM`` + split), every rank gathers the draws of the global batch (N x 8
bytes, no gradient) and puts each of its images in the group of its rank among them (position p of N goes to group
p G // N). W workers therefore form the same sub-batches as one process on the global batch, whatever the batch
order. A global batch that is not a multiple of w_size is split into G groups of N / G +- 1 images (the official
code refuses it), one smaller than w_size is one group (the official code's default when w_size is unset).

Distributed semantics (see `unison.losses.wmse`): each sub-batch's mean and covariance are all-reduced with
``all_reduce_with_grad`` (exactly the statistics of one process), every rank whitens its own rows and averages
over them; DDP's gradient average is the exact gradient of the global-batch loss. Exact with gather on and SyncBN;
with exact accumulation the sub-batches are drawn over the step's K micro-batches (one big batch).

A sub-batch of m images has a covariance of rank m - 1 at most: whitening a d-wide embedding needs m > d (the
paper uses w_size = 2 d). A run whose global batch or w_size leaves fewer is refused before it starts, unless
``w_eps`` > 0 shrinks the covariance towards the identity.

Example::

    backbone, dim = build_backbone("resnet18")
    model = WMSE(backbone, dim, WMSEParams())
    loss = model([view_a, view_b], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from unison.distributed.collectives import gather_no_grad, world_size
from unison.errors import ConfigError
from unison.losses import WMSELoss
from unison.models import mlp
from unison.rng import combine_key, hash64

from ._common import check_global_views, same_size_views
from .base import Recipe, SampleKeys, SSLMethod
from .params import check_params

GROUP_STREAM = 0x574D_5345   # + split index: counter-based RNG stream of the sub-batch draws


@dataclass
class WMSEParams:
    n_views: int = 2                # official "W-MSE 2" (W-MSE 4: 4)
    proj_hidden_dim: int = 1024     # official head_size
    proj_dim: int = 64              # official emb (CIFAR)
    w_size: int = 128               # images per whitening sub-batch (official, CIFAR)
    w_iter: int = 1                 # random splits per step, each whitened anew
    w_eps: float = 0.0              # shrinkage of the covariance towards the identity (official w_eps: 0)
    normalize: bool = True          # 2 - 2 cos of the whitened embeddings (official); False: their MSE

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim", "w_iter"), classes=("n_views", "w_size"))
        if not (isinstance(self.w_eps, (int, float)) and 0 <= self.w_eps < 1):
            raise ConfigError(f"WMSE parameter w_eps={self.w_eps!r} must be a number in [0, 1) (--param w_eps=VALUE)")
        if self.w_eps == 0 and self.w_size <= self.proj_dim:
            raise ConfigError(f"WMSE parameter w_size={self.w_size} must exceed proj_dim={self.proj_dim}: the "
                              f"covariance of {self.w_size} images has rank {self.w_size - 1} at most and a "
                              f"{self.proj_dim}-wide embedding cannot be whitened with it; give --param w_size="
                              f"{2 * self.proj_dim} (the paper's 2 x proj_dim), or --param w_eps=0.1")


def sub_batches(n_images: int, w_size: int) -> int:
    """The number of whitening sub-batches of a global batch of `n_images`."""
    return max(1, n_images // w_size)


class WMSE(SSLMethod):
    name = "wmse"
    Params = WMSEParams
    needs_sample_keys = True
    recipe = Recipe(optimizer="adam", base_lr=3e-3 / 2, weight_decay=1e-6, augmentation="wmse", views_param="n_views")

    @classmethod
    def smallest_batch(cls, params: Any) -> int:
        return 2 if params.w_eps else params.proj_dim + 1   # one sub-batch wider than the embedding

    @classmethod
    def check_run(cls, params: Any, *, global_batch: int, world_size: int, shared_queue: bool) -> None:
        smallest = cls.smallest_batch(params)
        if global_batch < smallest:
            raise ConfigError(
                f"batch_size={global_batch}: W-MSE whitens sub-batches of its global batch, and a {params.proj_dim}-"
                f"wide embedding needs more than {params.proj_dim} images in one (the covariance of m images has rank "
                f"m - 1); give --batch-size {smallest} or more (e.g. {2 * params.w_size}: sub-batches of "
                f"{params.w_size}, the paper's), a smaller --param proj_dim=, or --param w_eps=0.1 (shrinkage)")

    @classmethod
    def check_views(cls, params: Any, patch: int | None, view_sizes: Sequence[int]) -> None:
        check_global_views("W-MSE", view_sizes, exactly=params.n_views, presets="wmse, simclr or byol (as many views as n_views)")

    def __init__(self, backbone: nn.Module, feature_dim: int, params: WMSEParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 2)
        self.loss_fn = WMSELoss(params.w_eps, params.normalize, gather_distributed=self.gather_distributed)

    def groups(self, keys: SampleKeys, device: torch.device) -> tuple[torch.Tensor, int]:
        """The sub-batch of each of this rank's images in each of the w_iter splits (int64 [w_iter, n]) and the
        number of sub-batches: ranks of per-image random draws among the global batch's (module docstring)."""
        idx = keys.indices.to(device=device, dtype=torch.int64)
        draws = torch.cat([hash64(combine_key(keys.seed, keys.epoch, GROUP_STREAM + t), idx, 1)
                           for t in range(self.params.w_iter)] + [idx[:, None]], dim=1)   # [n, w_iter + 1]
        everyone = gather_no_grad(draws) if self.gather_distributed and world_size() > 1 else draws
        n_images = everyone.shape[0]
        g = sub_batches(n_images, self.params.w_size)
        index, all_index = draws[:, -1:], everyone[None, :, -1]
        out = []
        for t in range(self.params.w_iter):
            mine, all_draws = draws[:, t:t + 1], everyone[None, :, t]             # [n, 1], [1, N]
            below = (all_draws < mine) | ((all_draws == mine) & (all_index < index))   # ties: by sample index
            out.append(below.sum(dim=1) * g // n_images)
        return torch.stack(out), g

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        n = same_size_views(views, "W-MSE", self.params.n_views, "n_views")
        if keys is None:
            raise ValueError("W-MSE draws its sub-batches per sample: call it with keys=SampleKeys(seed, epoch, "
                             "indices)")
        whitened_over = n * (world_size() if self.gather_distributed else 1)   # images of one forward's sub-batches
        self.check_run(self.params, global_batch=whitened_over, world_size=world_size(), shared_queue=self.shared_queue)
        z = self.projector(torch.cat([self.backbone(v) for v in views]))   # backbone per view, head on all (official)
        groups, g = self.groups(keys, z.device)
        return self.loss_fn(z.reshape(len(views), n, -1), groups, g)
