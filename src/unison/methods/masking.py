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
* `inverse_block_masking`: CAPI. One block of exactly ``N - n_masked`` patches stays visible (the official
  ``InverseBlockMasking``: a rectangle of aspect ratio in [1/2, 2], log-uniform, cut to the count in row-major
  order, rolled around the grid by a random shift), every other patch is masked.

Example::

    keys = SampleKeys(seed=0, epoch=3, indices=torch.tensor([7, 42]))
    visible, masked = random_masking(keys, stream=MAE_STREAM, n_patches=64, n_masked=48)   # [2, 16], [2, 48]
    targets, context = block_masking(keys, stream=IJEPA_STREAM, grid=8, num_blocks=4, block=(3, 4))
    visible, masked = inverse_block_masking(keys, stream=CAPI_STREAM, grid=8, n_masked=41)   # [2, 23], [2, 41]
"""

from __future__ import annotations

import math

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


def inverse_block_masking(keys: SampleKeys, stream: int, grid: int, n_masked: int, min_aspect: float = 0.5,
                          device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [n, N - n_masked], masked [n, n_masked]) patch indices of each sample, ascending.

    The official ``BlockMasking`` of ``v = N - n_masked`` patches, inverted: aspect a = exp(U(lo, hi)) with
    lo = max(log min_aspect, log(v / grid**2)), hi = min(-log min_aspect, log(grid**2 / (v + 1e-5))) (the bounds
    keep the block on the grid); h = ceil(sqrt(v a)), w = ceil(sqrt(v / a)) (w also at least ceil(v / h), so that
    the rectangle holds v patches where rounding clips h to the grid); top-left corner uniform; the first v
    patches of the rectangle in row-major order stay visible; the pattern is rolled by a uniform shift of rows and
    columns (wrapping around). Five uniforms per sample from `stream` and a fixed sequence of tensor operations, no
    data-dependent loop: `unison plan`'s fake tensors run it as real ones do.
    """
    n_patches = grid * grid
    n_visible = n_patches - n_masked
    if not 1 <= n_visible < n_patches:
        raise ValueError(f"cannot mask {n_masked} of {n_patches} patches and keep a visible block")
    if not 0 < min_aspect <= 1:
        raise ValueError(f"min_aspect must be in (0, 1], got {min_aspect}")
    u = _uniform(keys, stream, 5, None).double()                                     # on the indices' device
    lo = max(math.log(min_aspect), math.log(n_visible / n_patches))
    hi = min(-math.log(min_aspect), math.log(n_patches / (n_visible + 1e-5)))
    aspect = torch.exp(lo + (hi - lo) * u[:, 0])
    h = torch.ceil(torch.sqrt(n_visible * aspect)).clamp(1, grid)
    w = torch.maximum(torch.ceil(torch.sqrt(n_visible / aspect)), torch.ceil(n_visible / h)).clamp(1, grid)
    top = (u[:, 1] * (grid - h + 1)).floor()
    left = (u[:, 2] * (grid - w + 1)).floor()
    shift_r, shift_c = (u[:, 3] * grid).floor(), (u[:, 4] * grid).floor()
    cells = torch.arange(grid, dtype=torch.float64, device=u.device)
    # cell (r, c) of the rolled grid came from cell ((r - shift_r) mod grid, (c - shift_c) mod grid) of the block's
    rows = torch.remainder(cells[None, :] - shift_r[:, None], grid)[:, :, None] - top[:, None, None]   # [n, g, 1]
    cols = torch.remainder(cells[None, :] - shift_c[:, None], grid)[:, None, :] - left[:, None, None]  # [n, 1, g]
    width = w[:, None, None]
    in_block = (rows >= 0) & (rows < h[:, None, None]) & (cols >= 0) & (cols < width)
    visible = (in_block & (rows * width + cols < n_visible)).reshape(-1, n_patches)
    order = (~visible).to(torch.int8).argsort(dim=1, stable=True)                 # visible first, each ascending
    if device is not None:
        order = order.to(device)
    return order[:, :n_visible], order[:, n_visible:]
