"""Weighted kNN classification of embeddings (Wu et al., 2018; Lightly's benchmark protocol).

For a query q and the k reference features f_j with highest cosine similarity s_j,
class scores are sum_j exp(s_j / t) * onehot(y_j) and the prediction is their argmax
(k = 200, t = 0.1 in Lightly's CIFAR-10 benchmarks).

Distributed: every rank embeds only its share of the reference and query sets; the
reference features are gathered (no gradient) so each rank can score its queries, and the
correct counts are summed over ranks. Nothing is embedded twice. Lightly embeds the whole
reference set on every rank.

Example::

    acc = knn_accuracy(model.embed, train_images, train_labels, val_images, val_labels, transform)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unison.distributed.collectives import all_reduce_no_grad, gather_no_grad, rank, world_size


def _shard(n: int) -> slice:
    w, r = world_size(), rank()
    per = -(-n // w)
    return slice(min(n, r * per), min(n, (r + 1) * per))


@torch.no_grad()
def embed_all(encode: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
              transform: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 512, *, calls: int = 0,
              filler: torch.Tensor | None = None) -> torch.Tensor:
    """L2-normalised features of `images` (uint8), computed in batches. `images` may also be lazily decoded
    (`unison.data.source.LazyImages`: ``decode(start, stop)`` gives the uint8 batch).

    `calls` > number of batches: `encode` is called on `filler` (discarded) until it has run `calls`
    times. A sharded (FSDP) encoder gathers its parameters in every call, a collective, so every rank
    must call it equally often even when the ranks' shares of the images differ in size."""
    lazy: Any = None if isinstance(images, torch.Tensor) else images
    feats = [F.normalize(encode(transform(lazy.decode(i, i + batch_size) if lazy else images[i:i + batch_size]))
                         .float(), dim=1)
             for i in range(0, images.shape[0], batch_size)]
    for _ in range(len(feats), calls):
        fill: Any = filler if filler is not None else images[:1]
        encode(transform(fill if isinstance(fill, torch.Tensor) else fill.decode()))
    return torch.cat(feats) if feats else torch.empty(0)


def _calls(n: int, batch_size: int) -> int:
    """encode calls of the rank with the largest share of n images (rank 0)."""
    largest_share = math.ceil(n / world_size())
    return math.ceil(largest_share / batch_size)


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
def knn_accuracy(encode: Callable[[torch.Tensor], torch.Tensor], ref_images: torch.Tensor, ref_labels: torch.Tensor,
                 query_images: torch.Tensor, query_labels: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor], num_classes: int, *, k: int = 200,
                 t: float = 0.1, batch_size: int = 512) -> float:
    """Top-1 kNN accuracy; every rank must call it (collective). Returns the same value on all ranks."""
    ref_part = _shard(ref_images.shape[0])
    bank = gather_no_grad(embed_all(encode, ref_images[ref_part], transform, batch_size,
                                    calls=_calls(ref_images.shape[0], batch_size), filler=ref_images[:1]), uneven=True)
    bank_labels = gather_no_grad(ref_labels[ref_part].to(bank.device), uneven=True)
    q_part = _shard(query_images.shape[0])
    query = embed_all(encode, query_images[q_part], transform, batch_size,
                      calls=_calls(query_images.shape[0], batch_size), filler=query_images[:1])
    correct = torch.zeros(2, dtype=torch.float64, device=bank.device)
    if query.shape[0]:
        pred = knn_predict(query, bank, bank_labels, num_classes, k, t)
        correct[0] = (pred == query_labels[q_part].to(pred.device)).sum()
        correct[1] = query.shape[0]
    total = all_reduce_no_grad(correct)
    return float(total[0] / total[1])
