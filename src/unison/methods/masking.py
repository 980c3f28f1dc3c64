"""Per-sample patch masks for MAE, iBOT, DINOv2 and I-JEPA, drawn from (seed, epoch, sample index) only.

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
* `dinov2_masking`: DINOv2 / DINOv3. With probability ``probability`` a sample is masked, with a
  target of ``floor(N * r)`` patches for r uniform in ``ratio_range`` (else none), by BEiT's block
  generator as DINOv2's ``MaskingGenerator`` runs it: rectangles of area uniform in
  [4, what is left] (at most N / 2 patches per rectangle) and aspect ratio log-uniform in
  [0.3, 1 / 0.3], each kept when it adds between 1 and what is left, until the target is met
  or 10 rectangles in a row fail. The count of masked patches differs from sample to sample;
  `padded_masked` lists them at one width, with weights 1 / count and 0 for the padding.
  Here the generator's tries are a fixed number (`MAX_MASK_TRIES`) of vectorised steps, a
  sample that is done ignoring the rest: no loop that reads tensor values on the host (a
  device sync per try, and a loop that never ends on `unison plan`'s fake tensors). The
  official loop stops on its own well before that many tries.
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
    is_masked = dinov2_masking(keys, stream=DINOV2_STREAM, grid=8, probability=0.5, ratio_range=(0.1, 0.5))
    masked, weights = padded_masked(is_masked, width=32)                                  # [2, 32], [2, 32]
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


# DINOv2's MaskingGenerator (data/masking.py): the smallest rectangle it draws, its aspect-ratio range, and the
# tries in a row after which a sample stops short of its target
MIN_BLOCK_PATCHES = 4
MIN_BLOCK_ASPECT = 0.3
BLOCK_TRIES_IN_A_ROW = 10
MAX_MASK_TRIES = 64   # the vectorised generator's tries per sample (`dinov2_masking`)


def dinov2_masking(keys: SampleKeys, stream: int, grid: int, probability: float, ratio_range: tuple[float, float],
                   device: torch.device | None = None, tries: int = MAX_MASK_TRIES, crops: int = 1) -> torch.Tensor:
    """bool [crops * n, grid * grid]: DINOv2's block mask of each sample (module docstring), row-major patches, for
    `crops` crops of every sample (crop-major; crop c from stream ``stream + c``), all drawn in one loop."""
    lo, hi = ratio_range
    if not 0.0 <= lo <= hi < 1.0:
        raise ValueError(f"mask ratios must satisfy 0 <= min <= max < 1, got {ratio_range}")
    n_patches = grid * grid
    u = torch.cat([_uniform(keys, stream + c, 2 + 4 * tries, device) for c in range(crops)]).double()
    n = u.shape[0]
    target = torch.where(u[:, 0] < probability, (n_patches * (lo + (hi - lo) * u[:, 1])).floor(),
                         torch.zeros_like(u[:, 0])).long()
    k = torch.arange(n_patches, device=u.device)
    row, col = (k // grid).unsqueeze(0), (k % grid).unsqueeze(0)
    mask = torch.zeros(n, n_patches, dtype=torch.bool, device=u.device)
    count = torch.zeros(n, dtype=torch.long, device=u.device)
    failed = torch.zeros(n, dtype=torch.long, device=u.device)   # failed tries in a row
    done = count >= target
    log_aspect = (math.log(MIN_BLOCK_ASPECT), math.log(1 / MIN_BLOCK_ASPECT))
    for t in range(tries):
        ua, ur, ut, ul = u[:, 2 + 4 * t:6 + 4 * t].unbind(1)
        left_over = torch.minimum(target - count, torch.full_like(target, n_patches // 2)).double()
        area = MIN_BLOCK_PATCHES + (left_over - MIN_BLOCK_PATCHES) * ua    # random.uniform(4, left_over)
        aspect = torch.exp(log_aspect[0] + (log_aspect[1] - log_aspect[0]) * ur)
        h, w = torch.sqrt(area * aspect).round().long(), torch.sqrt(area / aspect).round().long()
        fits = (h < grid) & (w < grid)
        top = (ut * (grid - h + 1).clamp(min=1)).floor().long().unsqueeze(1)
        left = (ul * (grid - w + 1).clamp(min=1)).floor().long().unsqueeze(1)
        rect = (row >= top) & (row < top + h.unsqueeze(1)) & (col >= left) & (col < left + w.unsqueeze(1))
        added = (rect & ~mask).sum(dim=1)
        kept = fits & (added > 0) & (added <= left_over) & ~done
        mask |= rect & kept.unsqueeze(1)
        count = count + torch.where(kept, added, 0)
        failed = torch.where(kept, 0, torch.where(done, failed, failed + 1))
        done = done | (count >= target) | (failed >= BLOCK_TRIES_IN_A_ROW)
    return mask


def padded_masked(is_masked: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [n, width], weights [n, width]) of each sample's masked patches, ascending, then padding: the
    weight of a masked patch is 1 / the sample's count, of the padding 0 (its index a masked or any patch)."""
    count = is_masked.sum(dim=1, keepdim=True)
    if is_masked.shape[1] < width:
        raise ValueError(f"cannot list up to {width} masked patches of {is_masked.shape[1]}")
    order = (~is_masked).to(torch.uint8).argsort(dim=1, stable=True)[:, :width]     # masked first, ascending
    slot = torch.arange(width, device=is_masked.device).unsqueeze(0)
    weights = torch.where(slot < count, 1.0 / count.clamp(min=1).double(), 0.0)
    return order, weights


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
