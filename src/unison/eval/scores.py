"""Top-1 and top-5 accuracy of a classifier on held-out images, every rank scoring its share.

Each rank takes its contiguous share of the held-out images (`contiguous_share`), decodes them a batch at a time
(`unison.data.evalsets.LazyImages`, or rows of a tensor), and counts its correct predictions; the counts are
summed over the ranks (`all_reduce_no_grad`), so every rank returns the same score, that of the whole set, and
it does not depend on the world size (counts are integers). Images that could not be decoded (``--on-corrupt
skip``) are left out and counted. Top-5 needs at least 5 classes (None below).

Example::

    scores = topk_accuracy(model, val_images, val_labels, to_eval, batch_size=512)
    scores.top1, scores.top5, scores.images
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unison.distributed.collectives import all_reduce_no_grad, contiguous_share, rank, world_size
from unison.errors import DataError
from unison.progress import Progress

__all__ = ["Scores", "topk_accuracy"]


@dataclass
class Scores:
    top1: float
    top5: float | None
    images: int          # scored (decoded) images
    unreadable: int


@torch.no_grad()
def topk_accuracy(model: Callable[[torch.Tensor], torch.Tensor], images: Any, labels: torch.Tensor,
                  to_eval: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 512,
                  num_classes: int | None = None, what: str = "scoring the held-out set",
                  device: torch.device | None = None) -> Scores:
    """Top-1/top-5 of `model` (images -> logits) on `images` (uint8, or lazily decoded) with `labels`; collective."""
    share = contiguous_share(images.shape[0], rank(), world_size())
    mine, mine_labels = images[share], labels[share]
    device = device or torch.device("cpu")   # where the collective runs: the model's device (NCCL: CUDA only)
    counts = torch.zeros(4, dtype=torch.float64, device=device)   # top-1, top-5, scored, unreadable
    progress = Progress(what, mine.shape[0], images.shape[0], show=rank() == 0)
    for i in range(0, mine.shape[0], batch_size):
        if isinstance(mine, torch.Tensor):
            x = mine[i:i + batch_size]
            ok = torch.ones(x.shape[0], dtype=torch.bool)
        else:
            x, ok = mine.decode(i, i + batch_size)
        logits = model(to_eval(x)).float()
        ok = ok.to(logits.device)
        y = mine_labels[i:i + batch_size].to(logits.device)[ok]
        logits = logits[ok]
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top == y[:, None]
        counts[0] += float(hit[:, 0].sum())
        counts[1] += float(hit.any(dim=1).sum())
        counts[2] += float(y.numel())
        counts[3] += float((~ok).sum())
        progress(min(i + batch_size, mine.shape[0]))
    total = all_reduce_no_grad(counts).cpu()
    if total[2] == 0:
        raise DataError("none of the held-out images could be read (--on-corrupt skip left them all out); fix the "
                        "data or give other --val data")
    classes = num_classes if num_classes is not None else 5
    return Scores(top1=float(total[0] / total[2]), top5=float(total[1] / total[2]) if classes >= 5 else None,
                  images=int(total[2]), unreadable=int(total[3]))
