"""TiCo's loss against its formula and against Lightly's `TiCoLoss` to 1e-9 over several steps, the running
covariance included (float64, W=1)."""

import pytest
import torch
import torch.nn.functional as F

from unison.losses import TiCoLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_tico_loss_is_its_formula_and_the_covariance_runs_over_steps():
    beta, rho, d = 0.9, 8.0, 5
    loss_fn = TiCoLoss(d, beta, rho).double()
    c = torch.zeros(d, d, dtype=torch.float64)
    for step in range(3):
        z, zt = _rand(6, d, seed=2 * step), _rand(6, d, seed=2 * step + 1)
        u, v = F.normalize(z, dim=1), F.normalize(zt, dim=1)
        c = beta * c + (1 - beta) * sum(torch.outer(u[i], u[i]) for i in range(6)) / 6
        expected = 1 - sum(float(u[i] @ v[i]) for i in range(6)) / 6 + rho * sum(float(u[i] @ c @ u[i])
                                                                             for i in range(6)) / 6
        assert float(loss_fn(z, zt)) == pytest.approx(expected, rel=1e-12)
        torch.testing.assert_close(loss_fn.covariance, c, rtol=1e-12, atol=1e-15)


def test_tico_loss_losses_gradients_and_covariance_equal_lightlys_over_three_steps():
    lightly_loss = pytest.importorskip("lightly.loss")
    ours, theirs = TiCoLoss(4, beta=0.9, rho=8.0).double(), lightly_loss.TiCoLoss(beta=0.9, rho=8.0)
    for step in range(3):
        z, zt = _rand(8, 4, seed=10 + step), _rand(8, 4, seed=20 + step)
        x, y = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
        mine, lightly = ours(x, zt), theirs(y, zt)
        torch.testing.assert_close(mine.detach(), lightly.detach(), rtol=1e-9, atol=1e-12)
        mine.backward()
        lightly.backward()
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ours.covariance, theirs.C, rtol=1e-9, atol=1e-12)


def test_tico_covariance_carries_no_gradient_and_moves_only_in_training():
    loss_fn = TiCoLoss(3).double()
    z = _rand(5, 3, seed=1).requires_grad_()
    loss_fn(z, _rand(5, 3, seed=2)).backward()
    assert not loss_fn.covariance.requires_grad and z.grad is not None
    before = loss_fn.covariance.clone()
    loss_fn.eval()
    loss_fn(_rand(5, 3, seed=3), _rand(5, 3, seed=4))
    assert torch.equal(loss_fn.covariance, before) and before.abs().sum() > 0


def test_tico_loss_refuses_embeddings_of_another_width():
    with pytest.raises(ValueError, match="covariance is 4 wide"):
        TiCoLoss(4).double()(_rand(3, 5), _rand(3, 5, seed=1))
