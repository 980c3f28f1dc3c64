"""Helpers shared by the methods: momentum (EMA) networks, schedules, multi-crop forwards, ViT checks.

* `momentum_copy(module)`: a frozen deep copy (``requires_grad=False``), the usual teacher /
  key encoder. Mark it with `mark_rank_local_state` so DDP never re-broadcasts it.
* `ema_update_(target, online, m)`: ``target <- m * target + (1 - m) * online`` for the
  parameters (buffers such as BN running statistics evolve through the target's own
  forward passes, as in the official MoCo / BYOL / DINO code).
* `cosine_momentum(base, step, total)`: ``1 - (1 - base) * (cos(pi * step / total) + 1) / 2``,
  the BYOL / DINO schedule from ``base`` (step 0) to 1 (step ``total``).
* `broadcast_once(owner, tensors)`: copy rank 0's values of rank-local state to every rank
  the first time it is called (a no-op afterwards and in a single process). DDP broadcasts
  the online parameters at construction but, by design, not rank-local state; without this
  a momentum encoder built from a different random initialisation on another rank would
  stay different forever. The trainer seeds every rank identically, so normally this
  changes nothing; it makes methods safe when they are built otherwise.
* `multicrop_features(backbone, views)`: the backbone applied to each run of consecutive
  views of the same size (one forward per resolution, as the official SwAV / DINO
  multi-crop wrapper), features concatenated in view order.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from unison.distributed.collectives import broadcast_, world_size
from unison.distributed.dtensor import is_sharded
from unison.errors import ConfigError
from unison.models.vit import ViT

# SwAV and DINO train their 2 global views only at 32 px and below (`Recipe.global_views_up_to`), LeJEPA at 16: on
# CIFAR-10 (32 px) and the embedded 16 px digits, with the small CNN, 2 views train a better encoder than 2 + 4
# local crops, in less time, as Lightly's and solo-learn's CIFAR-10 configurations train them (docs/benchmarks.md).
# LeJEPA: the same on the digits (its ViT), the only size it was compared at, hence its own bound. iBOT keeps its
# local crops: on the digits it does better with them.
TWO_VIEWS_UP_TO_PX = 32
TWO_VIEWS_MEASURED_UP_TO_PX = 16

_SYNCED_ATTR = "_unison_rank_local_synced"


def momentum_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters take no gradient."""
    target = copy.deepcopy(module)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


@torch.no_grad()
def ema_update_(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """target <- momentum * target + (1 - momentum) * online, parameter by parameter."""
    t: list[torch.Tensor] = list(target.parameters())
    o = [p.detach() for p in online.parameters()]
    if len(t) != len(o):
        raise RuntimeError(f"momentum network has {len(t)} parameters, online network {len(o)}")
    if not t:
        return
    torch._foreach_mul_(t, momentum)
    torch._foreach_add_(t, o, alpha=1.0 - momentum)


def cosine_momentum(base: float, step: float, total: int, final: float = 1.0) -> float:
    """final - (final - base) * (cos(pi * step / total) + 1) / 2, with step clamped to [0, total]."""
    if total <= 0:
        return base
    progress = min(max(step / total, 0.0), 1.0)
    return final - (final - base) * (math.cos(math.pi * progress) + 1) / 2


def broadcast_once(owner: nn.Module, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
    """On the first call for `owner`, overwrite every tensor of `tensors()` with rank 0's copy.

    Sharded (FSDP) parameters are skipped: each rank holds a different slice, and
    `unison.parallel.fsdp.apply_fsdp` broadcast them from rank 0 before sharding."""
    if owner.__dict__.get(_SYNCED_ATTR, False):
        return
    owner.__dict__[_SYNCED_ATTR] = True
    if world_size() > 1:
        for t in tensors():
            if not is_sharded(t):
                broadcast_(t.data)


def module_state(*modules: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules`."""
    out: list[torch.Tensor] = []
    for m in modules:
        out.extend(m.parameters())
        out.extend(m.buffers())
    return out


def multicrop_features(backbone: nn.Module, views: list[torch.Tensor]) -> torch.Tensor:
    """backbone(cat(group)) for each run of consecutive same-size views, concatenated in view order."""
    feats: list[torch.Tensor] = []
    start = 0
    while start < len(views):
        end = start + 1
        while end < len(views) and views[end].shape[1:] == views[start].shape[1:]:
            end += 1
        feats.append(backbone(torch.cat(views[start:end])))
        start = end
    return torch.cat(feats)


def two_views(views: list[torch.Tensor], method: str) -> tuple[torch.Tensor, torch.Tensor]:
    if len(views) != 2:
        raise ValueError(f"{method} takes exactly 2 views, got {len(views)}; use a two-view augmentation preset "
                         "(simclr, byol or digits), not multicrop")
    if views[0].shape != views[1].shape:
        raise ValueError(f"{method}: the two views differ in shape: {tuple(views[0].shape)} vs {tuple(views[1].shape)}")
    return views[0], views[1]


def check_global_views(method: str, view_sizes: Sequence[int], exactly: int | None = None, at_least: int = 2,
                       presets: str = "simclr, byol or mocov2") -> None:
    """`ConfigError` unless the augmentation's `view_sizes` (empty: not known before the build) are `exactly` views
    (else `at_least`) of one size: a method that compares whole views cannot take local crops, nor one view."""
    if not view_sizes:
        return
    count = len(view_sizes)
    fits = (count == exactly) if exactly is not None else count >= at_least
    if fits and len(set(view_sizes)) == 1:
        return
    wanted = f"exactly {exactly}" if exactly is not None else f"{at_least} or more"
    raise ConfigError(f"{method} takes {wanted} views of one size; the augmentation makes {count} "
                      f"({', '.join(str(s) for s in view_sizes)} px): give --augmentation {presets}, or leave "
                      "--augmentation and --local-crops out (the method's own)")


def same_size_views(views: list[torch.Tensor], method: str, expected: int, param: str) -> int:
    """Validate `expected` views of one shape (the views of a method whose view count is its parameter `param`);
    return the local batch size."""
    if len(views) != expected:
        raise ValueError(f"{method} takes {param}={expected} views per image, got {len(views)}; the augmentation makes "
                         f"as many as --param {param} asks (a preset without local crops)")
    if any(v.shape != views[0].shape for v in views[1:]):
        raise ValueError(f"{method}: every view must be one shape, got {sorted({tuple(v.shape) for v in views})}")
    return views[0].shape[0]


def check_multicrop(views: list[torch.Tensor], method: str) -> int:
    """Validate 2 global views (+ local crops, each batch the same size); return the local batch size."""
    if len(views) < 2:
        raise ValueError(f"{method} needs at least 2 global views, got {len(views)}")
    n = views[0].shape[0]
    if any(v.shape[0] != n for v in views):
        raise ValueError(f"{method}: every view must hold the same samples; batch sizes {[v.shape[0] for v in views]}")
    if views[0].shape != views[1].shape:
        raise ValueError(f"{method}: the two global views differ in shape: "
                         f"{tuple(views[0].shape)} vs {tuple(views[1].shape)}")
    return n


def require_vit(backbone: nn.Module, method: str) -> ViT:
    """`backbone` as a `unison.models.vit.ViT` (typed), or a ValueError naming the ViT backbones."""
    if not isinstance(backbone, ViT):
        raise ValueError(f"{method} needs a ViT backbone with patch tokens (--backbone vit_tiny_p4, vit_nano_p2, "
                         f"vit_small, ...), got {type(backbone).__name__}")
    return backbone


def mean_patch_embedding(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mean of a ViT's output patch tokens (the class token left out), [B, D]."""
    return require_vit(vit, "mean_patch_embedding").forward_tokens(x)[:, 1:].mean(dim=1)
