"""Weighted kNN against a direct restatement, and the sharded evaluation across real ranks."""

import torch
import torch.nn.functional as F
from helpers.knn import G

from unison.distributed.testing import run_in_workers
from unison.eval.knn import knn_accuracy, knn_predict

BANK = F.normalize(torch.randn(50, 8, generator=G), dim=1)


LABELS = torch.randint(0, 3, (50,), generator=G)


QUERY = F.normalize(torch.randn(7, 8, generator=G), dim=1)


def test_knn_predict_matches_formula_and_chunking():
    k, t = 5, 0.1
    expected = []
    for q in QUERY:
        sims = BANK @ q
        top = sims.argsort(descending=True)[:k]
        scores = torch.zeros(3)
        for j in top:
            scores[LABELS[j]] += torch.exp(sims[j] / t)
        expected.append(int(scores.argmax()))
    assert knn_predict(QUERY, BANK, LABELS, 3, k=k, t=t).tolist() == expected
    assert knn_predict(QUERY, BANK, LABELS, 3, k=k, t=t, chunk_size=2).tolist() == expected


# -- with real processes --

IMAGES = torch.randint(0, 256, (30, 3, 4, 4), generator=G, dtype=torch.uint8)


IMG_LABELS = torch.randint(0, 3, (30,), generator=G)


def _encode(x):
    return x.flatten(1)


def _to_float(x):
    return x.float() / 255


def _knn_worker():
    return knn_accuracy(_encode, IMAGES[:21], IMG_LABELS[:21], IMAGES[21:], IMG_LABELS[21:], _to_float, 3, k=4)


def test_sharded_knn_equals_single_process():
    single = knn_accuracy(_encode, IMAGES[:21], IMG_LABELS[:21], IMAGES[21:], IMG_LABELS[21:], _to_float, 3, k=4)
    assert run_in_workers(_knn_worker, 2) == [single, single]
