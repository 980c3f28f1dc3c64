"""Subsets and statistics of labelled image sets: pure functions of their inputs.

* `balanced_subset(labels, n, seed)`: n indices, as equal per class as possible (a class
  with too few images gives its share to the others), chosen by `seed` alone. Used for
  ``--subset`` / ``--val-subset`` and for the bounded kNN sets of streamed data.
* `channel_stats(images)`: per-channel mean / std in [0, 1] units from pixel histograms
  (exact integer counts, so the result does not depend on how the images are batched).

Example::

    keep = balanced_subset(labels, 5000, seed=0)      # sorted int64 indices
    mean, std = channel_stats(images[keep])           # uint8 [N, 3, H, W] -> two 3-tuples
"""

from __future__ import annotations

import torch

from unison.errors import DataError
from unison.rng import combine_key, hash64

__all__ = ["balanced_subset", "channel_stats"]

_SUBSET_STREAM = 0x5B5E7


def balanced_subset(labels: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Sorted indices of n samples, as equal per class as possible, a pure function of (labels, n, seed).

    Unlabelled samples (label -1) count as one class of their own.
    """
    N = labels.shape[0]
    if n > N:
        raise DataError(f"subset={n} is larger than the dataset ({N} images)")
    labels = labels.cpu()
    labels = labels - int(labels.min()) if N and int(labels.min()) < 0 else labels
    order = torch.argsort(hash64(combine_key(seed, _SUBSET_STREAM), torch.arange(N), 1)[:, 0], stable=True)
    lab = labels[order]
    by_class = torch.argsort(lab, stable=True)  # random order within each class
    counts = torch.bincount(lab)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(N, dtype=torch.int64)
    rank[by_class] = torch.arange(N) - starts[lab[by_class]]  # position within its class
    n_cls = counts.numel()
    cls_order = torch.argsort(hash64(combine_key(seed, _SUBSET_STREAM, 1), torch.arange(n_cls), 1)[:, 0], stable=True)
    cls_pos = torch.empty(n_cls, dtype=torch.int64)
    cls_pos[cls_order] = torch.arange(n_cls)  # which classes get the remainder
    # Round-robin over classes: the k-th image of every class before the (k+1)-th of any.
    pick = torch.argsort(rank * n_cls + cls_pos[lab], stable=True)[:n]
    return torch.sort(order[pick]).values


def channel_stats(images: torch.Tensor, max_images: int = 10_000) -> tuple[tuple[float, float, float],
                                                                         tuple[float, float, float]]:
    """Per-channel mean/std in [0, 1] units from pixel histograms of up to `max_images` evenly spaced images.

    A channel that is (nearly) constant gets std 1: dividing by its std of 0 would make every view NaN.
    """
    step = max(1, -(-images.shape[0] // max_images))
    x = images[::step].cpu().transpose(0, 1).reshape(3, -1)
    hist = torch.stack([torch.bincount(x[c], minlength=256) for c in range(3)]).to(torch.float64)
    v = torch.arange(256, dtype=torch.float64) / 255
    n = hist.sum(1).clamp_min(1)
    mean = (hist * v).sum(1) / n
    std = ((hist * (v - mean[:, None]) ** 2).sum(1) / n).sqrt()
    std = torch.where(std < 1e-3, torch.ones_like(std), std)  # a constant channel: normalising by 0 gives NaN
    m0, m1, m2 = (round(float(m), 6) for m in mean)
    s0, s1, s2 = (round(float(s), 6) for s in std)
    return (m0, m1, m2), (s0, s1, s2)
