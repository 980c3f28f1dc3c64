"""MSN (Assran et al., 2022): masked siamese networks, a masked anchor view against the unmasked target view.

    views:    target view x_t and anchor view x_a (two random crops of the image), focal views x_f (small crops)
    anchors:  a = h(f(x_a with a random mask_ratio of its patches dropped)), a_f = h(f(x_f))  backbone f (class
              token), projection head h (3 layers with batch norm and GELU); trained
    targets:  t = h'(f'(x_t))                   EMA of (f, h), all patches, no gradient
    loss      = MSNLoss(cat(a, a_f), t; prototypes P [K, d]): soft assignments to the learnable prototypes,
              sharpened and Sinkhorn-balanced targets, ME-MAX over the global batch (`unison.losses.msn`)
    f', h'   <- m f', h' + (1 - m) f, h,  m from 0.996 linearly towards 1, reaching 1 at 1.25 x the run (official)

Masking: MSN drops patches from the anchor view (``patch_drop``): the encoder sees floor((1 - mask_ratio) N) of
its N patches, drawn per sample from (seed, epoch, sample index) with `random_masking`, never from the rank (the
official code draws one set of patches for the whole batch on each GPU). As in the official code the focal views
are not masked and the projection head runs once per view group (anchor view; focal views together; target),
so its batch norm normalises each group separately.

Views: the first two views of the augmentation are the target and the anchor view, the rest focal views. The
``msn`` preset is the paper's: random crops from 30 % of the image and 10 focal crops of 5-30 % at 3/7 of the
image size (96 px at 224), SimCLR's colour jitter at strength 0.5, grey 0.2, blur 0.5 (off at 32 px and below).

Defaults (official ViT-S/16 ImageNet configuration ``msn_vits16.yaml``): mask ratio 0.15, 1024 prototypes of
width 256, temperature 0.1, sharpening 0.25, Sinkhorn 3 iterations, ME-MAX weight 1, momentum 0.996; the head's
hidden width is 512 (official 2048, reduced for CPU). Recipe: AdamW, lr 1e-3 at a global batch of 1024 (64 on
each of 16 GPUs) = 2.5e-4 per 256 images, weight decay 0.04, the ``msn`` preset, ``vit_tiny_auto``. Not
implemented: the weight-decay schedule 0.04 -> 0.4, gradient clipping at 3 (use the trainer's ``grad_clip``),
the exclusion of biases, norms and prototypes from weight decay (unison decays every parameter alike).
``embed(x)`` is the class token (the paper's linear evaluation reads it).

Distributed semantics: masks from the sample keys; Sinkhorn over the global batch and p_bar (ME-MAX) the
differentiable all-reduced global mean (`unison.losses.msn`); batch norm in the head needs SyncBN (global
statistics, as the official ``convert_sync_batchnorm``). The prototypes are ordinary parameters, so DDP averages
their gradient like every other (the official code sums their gradient over GPUs, outside DDP). Exact with
gather on. The target network and the step counter are rank-local state (a `MomentumTeacher`, saved in
checkpoints, copied from rank 0 on the first forward).

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = MSN(backbone, dim, MSNParams(), steps_total=10_000)
    loss = model([target_view, anchor_view, *focal_views], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from unison.distributed.tagging import mark_rank_local_state
from unison.errors import ConfigError
from unison.losses import MSNLoss
from unison.models import mlp

from ._common import check_multicrop, multicrop_features, require_vit
from .base import Recipe, SampleKeys, SSLMethod
from .masking import random_masking
from .params import check_params
from .teacher import MomentumTeacher

MASK_STREAM = 0x4D53_4E00     # counter-based RNG stream of MSN's anchor masks
MOMENTUM_HORIZON = 1.25       # the official schedules run over 1.25 x the training steps


@dataclass
class MSNParams:
    mask_ratio: float = 0.15             # official ViT-S/16 patch_drop (ViT-B/16: 0.3, ViT-L/7: 0.7)
    proj_hidden_dim: int = 512           # official: 2048 (reduced for CPU)
    proj_dim: int = 256                  # official output_dim
    n_prototypes: int = 1024             # official num_proto
    temperature: float = 0.1
    sharpen_temperature: float = 0.25    # official start_sharpen = final_sharpen
    sinkhorn_iterations: int = 3         # official use_sinkhorn (3 iterations)
    me_max_weight: float = 1.0           # official memax_weight
    momentum_base: float = 0.996         # official, linear towards 1

    def __post_init__(self) -> None:
        check_params(self, sizes=("proj_hidden_dim", "proj_dim"), classes=("n_prototypes",),
                     counts=("sinkhorn_iterations",), temperatures=("temperature", "sharpen_temperature"),
                     non_negative=("me_max_weight",), unit_interval=("mask_ratio", "momentum_base"))
        if self.mask_ratio >= 1:
            raise ConfigError(f"{_label(self)} parameter mask_ratio={self.mask_ratio} drops every patch of the "
                              "anchor view; give a ratio below 1 (--param mask_ratio=0.15)")


def _label(params: MSNParams) -> str:
    return type(params).__name__.removesuffix("Params")


def kept_patches(params: MSNParams, n_patches: int) -> int:
    """How many of the anchor view's `n_patches` patches the encoder sees (official ``patch_drop``); ConfigError
    if none."""
    kept = math.floor(n_patches * (1 - params.mask_ratio))
    if kept < 1:
        raise ConfigError(f"{_label(params)} mask_ratio={params.mask_ratio} keeps none of the {n_patches} patches of "
                          f"the anchor view; give a smaller ratio (--param mask_ratio=VALUE) or smaller patches")
    return kept


class MSN(SSLMethod):
    step_count: torch.Tensor
    name = "msn"
    Params = MSNParams
    needs_sample_keys = True
    unsharded_children = ("prototypes",)   # forward reads prototypes.weight itself
    recipe = Recipe(optimizer="adamw", base_lr=2.5e-4, weight_decay=0.04, augmentation="msn",
                    backbone="vit_tiny_auto", embedded={"backbone": "vit_nano_p4", "base_lr": 1e-3})

    def __init__(self, backbone: nn.Module, feature_dim: int, params: MSNParams, **kw):
        super().__init__(backbone, feature_dim, params, **kw)
        require_vit(backbone, self.title())
        self.projector = mlp(feature_dim, params.proj_hidden_dim, params.proj_dim, 3, activation=nn.GELU)
        for m in self.projector.modules():
            if isinstance(m, nn.Linear):   # official init_model: truncated normal, zero biases
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.prototypes = nn.Linear(params.proj_dim, params.n_prototypes, bias=False)
        bound = 1 / math.sqrt(params.proj_dim)   # official: uniform in +-1/sqrt(output_dim)
        nn.init.uniform_(self.prototypes.weight, -bound, bound)
        self.target = MomentumTeacher(backbone=self.backbone, projector=self.projector)
        self.register_buffer("step_count", torch.zeros((), dtype=torch.long))
        mark_rank_local_state(self, ["step_count"])
        self.loss_fn = self.build_loss(params)

    def build_loss(self, params: MSNParams) -> MSNLoss:
        return MSNLoss(params.temperature, params.sinkhorn_iterations, params.me_max_weight,
                       gather_distributed=self.gather_distributed)

    @classmethod
    def title(cls) -> str:
        return cls.name.upper()

    def momentum(self, step: float) -> float:
        base, step = self.params.momentum_base, self.schedule_step(step)
        horizon = MOMENTUM_HORIZON * max(self.steps_total, 1)
        return base + (1 - base) * min(max(step / horizon, 0.0), 1.0)

    @classmethod
    def check_views(cls, params: MSNParams, patch: int | None, view_sizes: Sequence[int]) -> None:
        if patch and len(view_sizes) > 1 and view_sizes[1] % patch == 0:   # else: the ViT's own one-line refusal
            kept_patches(params, (view_sizes[1] // patch) ** 2)

    def anchor_mask(self, keys: SampleKeys, n_patches: int, device: torch.device) -> torch.Tensor:
        """The kept patches [n, floor((1 - mask_ratio) N)] of each sample's anchor view (official ``patch_drop``)."""
        kept = kept_patches(self.params, n_patches)
        return random_masking(keys, MASK_STREAM, n_patches, n_patches - kept, device)[0]

    def forward(self, views: list[torch.Tensor], keys: SampleKeys | None = None) -> torch.Tensor:
        if keys is None:
            raise ValueError(f"{self.title()} draws its masks per sample: call it with "
                             "keys=SampleKeys(seed, epoch, indices)")
        check_multicrop(views, self.title())
        vit = require_vit(self.backbone, self.title())
        target_view, anchor_view, focal = views[0], views[1], views[2:]
        keep = self.anchor_mask(keys, vit.num_patches(anchor_view.shape[-1]), anchor_view.device)
        self.target.sync_once()
        with torch.no_grad():
            t = self.target.projector(self.target.backbone(target_view))
        anchors = [self.projector(vit.forward_tokens(anchor_view, keep=keep)[:, 0])]
        if focal:
            anchors.append(self.projector(multicrop_features(self.backbone, focal)))
        return self.loss_fn(torch.cat(anchors), t, self.prototypes.weight, self.params.sharpen_temperature)

    @torch.no_grad()
    def on_after_step(self, step: int) -> None:
        self.target.update(self, self.momentum(step))
        self.step_count.fill_(step + 1)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: Sinkhorn and the mean prediction (ME-MAX) use each rank's local batch"
        return None
