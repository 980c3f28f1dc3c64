"""NNCLR's loss and nearest-neighbour lookup against their formula, and the lookup against Lightly's
`NNMemoryBankModule` (float64, W=1).

Deliberate difference: Lightly's NNCLR example scores NN(z) against the other view's predictions with NT-Xent,
whose candidates also hold the other nearest neighbours (2N - 1 of them); unison's loss is the paper's eq. 2 (the
predictions only) with its symmetric term, so the loss itself is compared with the formula, not with Lightly."""

import math

import pytest
import torch
import torch.nn.functional as F

from unison.losses import NNCLRLoss, nearest_neighbours


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _formula(q, p, t, symmetric):
    q, p = F.normalize(q, dim=1), F.normalize(p, dim=1)
    n = q.shape[0]
    s = [[float(q[i] @ p[k]) / t for k in range(n)] for i in range(n)]
    rows = sum(-s[i][i] + math.log(sum(math.exp(s[i][k]) for k in range(n))) for i in range(n)) / n
    if not symmetric:
        return rows
    cols = sum(-s[i][i] + math.log(sum(math.exp(s[k][i]) for k in range(n))) for i in range(n)) / n
    return (rows + cols) / 2


@pytest.mark.parametrize("symmetric", [True, False])
def test_nnclr_loss_is_its_formula(symmetric):
    q, p = _rand(6, 5, seed=1), _rand(6, 5, seed=2)
    assert float(NNCLRLoss(0.1, symmetric)(q, p)) == pytest.approx(_formula(q, p, 0.1, symmetric), rel=1e-12)


def test_nnclr_loss_trains_the_predictions_only():
    q, p = _rand(4, 3, seed=3).requires_grad_(), _rand(4, 3, seed=4).requires_grad_()
    NNCLRLoss()(q, p).backward()
    assert q.grad is None and p.grad is not None and p.grad.abs().sum() > 0


def test_nearest_neighbours_are_the_most_cosine_similar_rows():
    support = F.normalize(_rand(50, 4, seed=5), dim=1)
    z = _rand(7, 4, seed=6) * 3.0                        # unnormalised: the lookup is by cosine
    nn = nearest_neighbours(z, support)
    for i in range(7):
        best = max(range(50), key=lambda j: float(F.cosine_similarity(z[i], support[j], dim=0)))
        assert torch.equal(nn[i], support[best])


def test_nearest_neighbours_equal_lightlys_memory_bank():
    modules = pytest.importorskip("lightly.models.modules")
    bank = modules.NNMemoryBankModule(size=(32, 4)).double()
    support = F.normalize(_rand(32, 4, seed=7), dim=1)
    bank.bank.copy_(support)
    z = _rand(8, 4, seed=8)
    torch.testing.assert_close(nearest_neighbours(z, support), bank(z, update=False), rtol=1e-12, atol=0)


def test_nearest_neighbours_refuse_a_support_set_of_another_width():
    with pytest.raises(ValueError, match=r"support set must be \[K, 4\]"):
        nearest_neighbours(_rand(2, 4), _rand(5, 3))
