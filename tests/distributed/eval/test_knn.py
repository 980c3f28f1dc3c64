"""Weighted kNN against a direct restatement, and the sharded evaluation across real ranks."""

import torch
from helpers.knn import G

from unison.distributed.testing import run_in_workers
from unison.eval.knn import knn_accuracy

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
