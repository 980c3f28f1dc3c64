"""WMSELoss against Lightly's WMSELoss (float64, 1e-9: the same sub-batches, drawn by Lightly's ``torch.randperm``
and given to unison as groups), the whitening itself (identity covariance in every sub-batch) and its gradient.
Its distributed form (W ranks == one process) is checked by `unison check` for every method."""

from __future__ import annotations

import pytest
import torch

from unison.losses import WMSELoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _lightly_groups(bs: int, w_size: int, w_iter: int, seed: int) -> torch.Tensor:
    """The sub-batch of every image in each of Lightly's w_iter ``torch.randperm(bs).view(-1, w_size)`` draws."""
    torch.manual_seed(seed)
    groups = torch.empty(w_iter, bs, dtype=torch.int64)
    for t in range(w_iter):
        perm = torch.randperm(bs).view(-1, w_size)
        for g, rows in enumerate(perm):
            groups[t, rows] = g
    return groups


@pytest.mark.parametrize("views, w_iter, eps", [(2, 1, 0.0), (4, 2, 0.0), (2, 1, 0.1)])
def test_wmse_loss_agrees_with_lightly(views, w_iter, eps):
    wmse = pytest.importorskip("lightly.loss").WMSELoss
    bs, d, w_size = 32, 4, 16
    z = _rand(views, bs, d)
    groups = _lightly_groups(bs, w_size, w_iter, seed=3)
    torch.manual_seed(3)   # Lightly draws the same permutations
    theirs = wmse(embedding_dim=d, eps=eps, w_iter=w_iter, w_size=w_size, num_samples=views)(z.reshape(-1, d))
    ours = WMSELoss(eps=eps)(z, groups, bs // w_size)
    assert abs(ours.item() - theirs.item()) < 1e-9


def test_whitened_sub_batches_have_identity_covariance_and_zero_mean():
    z = _rand(2, 30, 3, seed=1) @ _rand(3, 3, seed=2)        # correlated features
    group = torch.arange(30) % 3                              # 3 sub-batches of 10
    w = WMSELoss().whiten(z, group, 3)
    for v in range(2):
        for g in range(3):
            rows = w[v, group == g]
            torch.testing.assert_close(rows.mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
            torch.testing.assert_close(rows.T @ rows / (len(rows) - 1), torch.eye(3, dtype=torch.float64))


def test_wmse_loss_is_the_normalised_mse_of_whitened_views():
    """2 - 2 cos averaged over images and view pairs; the plain MSE with ``normalize=False``."""
    z, group = _rand(3, 12, 2, seed=4), torch.arange(12) % 2
    w = WMSELoss().whiten(z, group, 2)
    pairs = [(a, b) for a in range(3) for b in range(a + 1, 3)]
    cos = [torch.nn.functional.cosine_similarity(w[a], w[b], dim=-1) for a, b in pairs]
    expected = sum((2 - 2 * c).mean() for c in cos) / 3
    assert WMSELoss()(z, group[None], 2).item() == pytest.approx(expected.item(), rel=1e-12)
    mse = sum(((w[a] - w[b]) ** 2).mean() for a, b in pairs) / 3
    assert WMSELoss(normalize=False)(z, group[None], 2).item() == pytest.approx(mse.item(), rel=1e-12)


def test_wmse_loss_gradient_matches_finite_differences():
    z = _rand(2, 10, 2, seed=5).requires_grad_(True)
    group = (torch.arange(10) % 2)[None]
    assert torch.autograd.gradcheck(lambda x: WMSELoss()(x, group, 2), (z,), eps=1e-6, atol=1e-6)
