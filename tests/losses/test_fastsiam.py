"""FastSiam's loss against its formula, against Lightly's FastSiam step (its example's loop over
`NegativeCosineSimilarity`) to 1e-9, and against SimSiam's loss at two views (float64)."""

import pytest
import torch
import torch.nn.functional as F

from unison.losses import FastSiamLoss, SimSiamLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_fastsiam_loss_is_its_formula():
    k, n = 4, 5
    p, z = [_rand(n, 6, seed=v) for v in range(k)], [_rand(n, 6, seed=10 + v) for v in range(k)]
    expected = 0.0
    for v in range(k):
        for i in range(n):
            target = sum(z[u][i] for u in range(k) if u != v) / (k - 1)
            expected -= float(F.cosine_similarity(p[v][i], target, dim=0))
    assert float(FastSiamLoss()(p, z)) == pytest.approx(expected / (k * n), rel=1e-12)


def test_fastsiam_loss_and_gradients_equal_lightlys_step():
    lightly_loss = pytest.importorskip("lightly.loss")
    criterion = lightly_loss.NegativeCosineSimilarity()
    p = [_rand(6, 8, seed=v) for v in range(4)]
    z = [_rand(6, 8, seed=20 + v) for v in range(4)]
    mine_p = [t.clone().requires_grad_(True) for t in p]
    their_p = [t.clone().requires_grad_(True) for t in p]
    mine = FastSiamLoss()(mine_p, z)
    zs, ps = torch.stack(z), torch.stack(their_p)
    lightly = sum(criterion(ps[i], torch.mean(zs[torch.arange(4) != i], dim=0)) / 4 for i in range(4))
    torch.testing.assert_close(mine.detach(), lightly.detach(), rtol=1e-9, atol=1e-12)
    mine.backward()
    lightly.backward()
    for x, y in zip(mine_p, their_p):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)


def test_fastsiam_at_two_views_is_simsiam_and_stops_the_targets_gradient():
    p_a, p_b, z_a, z_b = (_rand(5, 4, seed=s) for s in range(4))
    assert float(FastSiamLoss()([p_a, p_b], [z_a, z_b])) == pytest.approx(float(SimSiamLoss()(p_a, p_b, z_a, z_b)),
                                                                         rel=1e-12)
    z = [_rand(3, 4, seed=s).requires_grad_() for s in range(3)]
    p = [_rand(3, 4, seed=5 + s).requires_grad_() for s in range(3)]
    FastSiamLoss()(p, z).backward()
    assert all(t.grad is None for t in z) and all(t.grad is not None for t in p)


def test_fastsiam_loss_refuses_one_view_and_mismatched_lists():
    with pytest.raises(ValueError, match="at least 2 views"):
        FastSiamLoss()([_rand(2, 3)], [_rand(2, 3)])
    with pytest.raises(ValueError, match="at least 2 views"):
        FastSiamLoss()([_rand(2, 3)] * 3, [_rand(2, 3)] * 2)
