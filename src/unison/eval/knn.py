"""Weighted kNN classification of embeddings (Wu et al., 2018; Lightly's benchmark protocol).

For a query q and the k reference features f_j with highest cosine similarity s_j,
class scores are sum_j exp(s_j / t) * onehot(y_j) and the prediction is their argmax
(k = 200, t = 0.1 in Lightly's CIFAR-10 benchmarks).

Distributed: every rank embeds only its share of the reference and query sets; the
reference features are gathered (no gradient) so each rank can score its queries, and the
correct counts are summed over ranks. Nothing is embedded twice. Lightly embeds the whole
reference set on every rank.

Images that could not be decoded (`unison.data.evalsets.LazyImages`, ``--on-corrupt skip``) are left
out of the reference set and of the queries; their number is summed over the ranks and reported once,
by rank 0, as one warning line. Embedding that takes more than a few seconds shows its progress on
standard error (rank 0, at most every `unison.progress.PROGRESS_EVERY_S` seconds): ``kNN: embedding the reference set
2,560/5,000 images (12 s)``.

Example::

    acc = knn_accuracy(model.embed, train_images, train_labels, val_images, val_labels, transform)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, contiguous_share, gather_no_grad, rank, world_size
from unison.errors import DataError
from unison.progress import Progress


def _shard(n: int) -> slice:
    return contiguous_share(n, rank(), world_size())


@torch.no_grad()
def embed_all(encode: Callable[[torch.Tensor], torch.Tensor], images: Any,
              transform: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 512, *, calls: int = 0,
              filler: Any = None, normalise: bool = True,
              progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of `images` (uint8, L2-normalised unless `normalise` is False) computed in batches, and a bool
    mask of the rows that could be decoded. `images` may be lazily decoded (`unison.data.evalsets.LazyImages`:
    ``decode(start, stop)`` gives the uint8 batch and its mask); a tensor's rows all count as decoded.

    `calls` > number of batches: `encode` is called on `filler` (discarded) until it has run `calls`
    times. A sharded (FSDP) encoder gathers its parameters in every call, a collective, so every rank
    must call it equally often even when the ranks' shares of the images differ in size."""
    lazy = not isinstance(images, torch.Tensor)
    feats, oks = [], []
    for i in range(0, images.shape[0], batch_size):
        if lazy:
            x, ok = images.decode(i, i + batch_size)
        else:
            x = images[i:i + batch_size]
            ok = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        f = encode(transform(x)).float()
        feats.append(F.normalize(f, dim=1) if normalise else f)
        oks.append(ok.to(f.device))
        if progress is not None:
            progress(min(i + batch_size, images.shape[0]))
    for _ in range(len(feats), calls):
        fill = filler if filler is not None else images[:1]
        encode(transform(fill.decode()[0] if not isinstance(fill, torch.Tensor) else fill))
    if not feats:
        return torch.empty(0), torch.empty(0, dtype=torch.bool)
    return torch.cat(feats), torch.cat(oks)


def _calls(n: int, batch_size: int) -> int:
    """encode calls of the rank with the largest share of n images (rank 0)."""
    largest_share = math.ceil(n / world_size())
    return math.ceil(largest_share / batch_size)


def report_unreadable(count: int, *sets: Any) -> None:
    """One warning for `count` images (the total over all ranks) left out of the kNN sets, once per set."""
    records = [s.unreadable for s in sets if hasattr(s, "unreadable")]
    if count == 0 or all(r.reported for r in records):
        return
    for r in records:
        r.reported = True
    example = next((f for r in records for f in r.files.values()), None)
    eg = f", e.g. {example}" if example else ""
    warnings.warn(f"kNN: left out {count} unreadable image(s) (--on-corrupt skip){eg}", stacklevel=2)


@torch.no_grad()
def knn_predict(query: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor, num_classes: int,
                k: int = 200, t: float = 0.1, chunk_size: int = 1024) -> torch.Tensor:
    """Predicted labels [Q] for normalised `query` [Q, d] against normalised `bank` [N, d]."""
    k = min(k, bank.shape[0])
    preds = []
    for chunk in query.split(chunk_size):                  # bounds memory at [chunk, N] similarities
        top_sim, top_idx = (chunk @ bank.T).topk(k, dim=1)  # [chunk, k]
        weights = (top_sim / t).exp()
        votes = torch.zeros(chunk.shape[0], num_classes, device=query.device, dtype=weights.dtype)
        votes.scatter_add_(1, bank_labels[top_idx], weights)
        preds.append(votes.argmax(dim=1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=query.device)


@torch.no_grad()
def knn_accuracy(encode: Callable[[torch.Tensor], torch.Tensor], ref_images: Any, ref_labels: torch.Tensor,
                 query_images: Any, query_labels: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor], num_classes: int, *, k: int = 200,
                 t: float = 0.1, batch_size: int = 512) -> float:
    """Top-1 kNN accuracy; every rank must call it (collective). Returns the same value on all ranks."""
    show = rank() == 0
    ref_part = _shard(ref_images.shape[0])
    share = ref_part.stop - ref_part.start
    bank, ok = embed_all(encode, ref_images[ref_part], transform, batch_size,
                         calls=_calls(ref_images.shape[0], batch_size), filler=ref_images[:1],
                         progress=Progress("kNN: embedding the reference set", share, ref_images.shape[0], show))
    bank_labels = gather_no_grad(ref_labels[ref_part].to(bank.device), uneven=True)
    bank_ok = gather_no_grad(ok.to(bank.device, torch.uint8), uneven=True).bool()   # gloo gathers no bool
    bank = gather_no_grad(bank, uneven=True)
    bank, bank_labels = bank[bank_ok], bank_labels[bank_ok]
    q_part = _shard(query_images.shape[0])
    query, q_ok = embed_all(encode, query_images[q_part], transform, batch_size,
                            calls=_calls(query_images.shape[0], batch_size), filler=query_images[:1],
                            progress=Progress("kNN: embedding the queries", q_part.stop - q_part.start,
                                              query_images.shape[0], show))
    counts = torch.zeros(3, dtype=torch.float64, device=bank.device)
    counts[2] = float((~bank_ok).sum()) / world_size()   # every rank holds the gathered mask: count it once
    if query.shape[0]:
        labels = query_labels[q_part].to(query.device)[q_ok]
        query = query[q_ok]
        counts[2] += float((~q_ok).sum())
        if query.shape[0] and bank.shape[0]:
            pred = knn_predict(query, bank, bank_labels, num_classes, k, t)
            counts[0] = (pred == labels).sum()
        counts[1] = query.shape[0]
    total = all_reduce_no_grad(counts)
    if show:
        report_unreadable(round(float(total[2])), ref_images, query_images)
    if total[1] == 0 or bank.shape[0] == 0:   # the same on every rank: the counts and the bank are global
        which = "held-out" if bank.shape[0] else "reference"
        raise DataError(f"kNN: none of the {which} images could be read (--on-corrupt skip left them all out); "
                        "fix the data or give other --val data")
    return float(total[0] / total[1])
