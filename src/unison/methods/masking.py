"""Per-sample patch masks for MAE, iBOT and I-JEPA, drawn from (seed, epoch, sample index) only.

Every draw goes through `unison.rng.sample_uniform(seed, epoch, indices, stream,
count)`, a pure function of its coordinates, so the mask of a sample is the same whatever
the world size, the rank it lands on and the other samples of its batch: a W-worker run
masks exactly as one process on the global batch does. Patches are numbered row-major on
the ``grid x grid`` patch grid.

Shapes are static: every sample of a batch gets the same number of masked, kept, target
and context patches, so per-sample losses are plain means and the batch never has to
agree on a size (the official I-JEPA collator truncates every mask to the smallest one in
the batch, which makes a sample's mask depend on the other samples, hence on the world size).

* `random_masking`: MAE / iBOT. A random priority per patch; the ``n_masked`` lowest are
  masked, the others visible (both returned in ascending patch order).
* `block_masking`: I-JEPA. ``num_blocks`` target blocks of ``h x w`` patches, each transposed
  to ``w x h`` with probability 1/2 (the aspect-ratio range ``(h/w, w/h)`` of the paper with a
  fixed patch count), at uniform positions; blocks may overlap. The context is a random
  subset of ``N - num_blocks * h * w`` patches outside every target block (the paper's
  context block covers 85-100 % of the image; here it is the whole image minus the targets,
  thinned at random to the fixed count when blocks overlap).

Example::

    keys = SampleKeys(seed=0, epoch=3, indices=torch.tensor([7, 42]))
    visible, masked = random_masking(keys, stream=MAE_STREAM, n_patches=64, n_masked=48)   # [2, 16], [2, 48]
    targets, context = block_masking(keys, stream=IJEPA_STREAM, grid=8, num_blocks=4, block=(3, 4))
"""

from __future__ import annotations

import torch

from unison.rng import sample_uniform

from .base import SampleKeys


def _uniform(keys: SampleKeys, stream: int, count: int, device: torch.device | None) -> torch.Tensor:
    u = sample_uniform(keys.seed, keys.epoch, keys.indices, stream, count)
    return u.to(device) if device is not None else u


def random_masking(keys: SampleKeys, stream: int, n_patches: int, n_masked: int,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [n, N - n_masked], masked [n, n_masked]) patch indices of each sample, ascending."""
    if not 0 <= n_masked <= n_patches:
        raise ValueError(f"cannot mask {n_masked} of {n_patches} patches")
    order = _uniform(keys, stream, n_patches, device).argsort(dim=1, stable=True)
    masked, visible = order[:, :n_masked], order[:, n_masked:]
    return visible.sort(dim=1).values, masked.sort(dim=1).values


def block_masking(keys: SampleKeys, stream: int, grid: int, num_blocks: int, block: tuple[int, int],
                  device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [n, num_blocks, h * w], context [n, N - num_blocks * h * w]) patch indices of each sample.

    Uses streams `stream` (block orientations and positions) and `stream + 1` (context thinning).
    """
    h, w = block
    n_patches = grid * grid
    n_context = n_patches - num_blocks * h * w
    if min(h, w) < 1 or max(h, w) > grid:
        raise ValueError(f"target blocks of {h} x {w} patches do not fit a {grid} x {grid} patch grid")
    if n_context < 1:
        raise ValueError(f"{num_blocks} target blocks of {h} x {w} patches leave no context patch of {n_patches}; "
                         "use fewer or smaller blocks (num_targets, target_scale) or smaller patches")
    n = keys.indices.shape[0]
    u = _uniform(keys, stream, 3 * num_blocks, device).double().view(n, num_blocks, 3)
    flip = u[..., 0] < 0.5                                               # w x h instead of h x w
    bh = torch.where(flip, w, h)
    bw = torch.where(flip, h, w)
    top = (u[..., 1] * (grid - bh + 1)).floor().long()
    left = (u[..., 2] * (grid - bw + 1)).floor().long()
    k = torch.arange(h * w, device=top.device)
    width = bw.unsqueeze(-1)                                             # row-major inside the block
    targets = (top.unsqueeze(-1) + k // width) * grid + left.unsqueeze(-1) + k % width     # [n, M, h*w]
    in_target = torch.zeros(n, n_patches, dtype=torch.bool, device=top.device)
    in_target.scatter_(1, targets.reshape(n, -1), True)
    priority = _uniform(keys, stream + 1, n_patches, device).double() + 2.0 * in_target   # targets sort last
    context = priority.argsort(dim=1, stable=True)[:, :n_context].sort(dim=1).values
    return targets, context
