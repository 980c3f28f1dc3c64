"""DCL and DCLW losses against their formula (eq. 6 of Yeh et al.), and against Lightly's to 1e-9 (float64, W=1)."""

import math
import warnings

import pytest
import torch

from unison.losses import DCLLoss, DCLWLoss, NTXentLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _formula(z_a, z_b, t, sigma=None):
    """Loop-level eq. 6: every anchor of both views, its positive out of the log-sum-exp."""
    n = z_a.shape[0]
    a = [v / v.norm() for v in z_a]
    b = [v / v.norm() for v in z_b]
    if sigma is None:
        w = [1.0] * n
    else:
        e = [math.exp(float(a[i] @ b[i]) / sigma) for i in range(n)]
        w = [2 - e[i] / (sum(e) / n) for i in range(n)]
    total = 0.0
    for views in ((a, b), (b, a)):
        u, v = views
        for i in range(n):
            negatives = [float(u[i] @ u[j]) / t for j in range(n) if j != i] + \
                        [float(u[i] @ v[j]) / t for j in range(n) if j != i]
            total += -w[i] * float(u[i] @ v[i]) / t + math.log(sum(math.exp(x) for x in negatives))
    return total / (2 * n)


@pytest.mark.parametrize("sigma", [None, 0.5])
def test_dcl_loss_is_its_formula(sigma):
    z_a, z_b = _rand(6, 5, seed=1), _rand(6, 5, seed=2)
    loss = DCLLoss(0.2, sigma=sigma)(z_a, z_b)
    assert float(loss) == pytest.approx(_formula(z_a, z_b, 0.2, sigma), rel=1e-12)


def test_dcl_differs_from_ntxent_by_the_positive_in_the_denominator():
    """NT-Xent's denominator holds the positive too: its loss is DCL's plus log(1 + exp(pos) / sum exp(neg))."""
    z_a, z_b = _rand(5, 4, seed=3), _rand(5, 4, seed=4)
    assert float(NTXentLoss(0.5)(z_a, z_b)) > float(DCLLoss(0.5)(z_a, z_b))


@pytest.mark.parametrize("weighted", [False, True])
def test_dcl_losses_and_gradients_equal_lightlys(weighted):
    lightly_loss = pytest.importorskip("lightly.loss")
    z_a, z_b = _rand(8, 6, seed=5), _rand(8, 6, seed=6)
    ours = DCLWLoss(0.1, 0.5) if weighted else DCLLoss(0.1)
    theirs = lightly_loss.DCLWLoss(temperature=0.1, sigma=0.5) if weighted else lightly_loss.DCLLoss(temperature=0.1)
    xs = [z.clone().requires_grad_(True) for z in (z_a, z_b)]
    ys = [z.clone().requires_grad_(True) for z in (z_a, z_b)]
    mine = ours(*xs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # Lightly's DCLW weights: torch.tensor() of a tensor
        lightly = theirs(*ys)
    torch.testing.assert_close(mine.detach(), lightly.detach(), rtol=1e-9, atol=1e-12)
    mine.backward()
    lightly.backward()
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)


def test_dclw_weights_carry_no_gradient_and_average_to_one():
    z_a, z_b = _rand(7, 3, seed=7), _rand(7, 3, seed=8)
    loss_fn = DCLWLoss(0.1, 0.5)
    a = torch.nn.functional.normalize(z_a, dim=1)
    b = torch.nn.functional.normalize(z_b, dim=1)
    w = loss_fn._weights(a, b, torch.arange(7), 0.5)
    assert not w.requires_grad and float(w.mean()) == pytest.approx(1.0, abs=1e-12)   # 2 - mean(softmax * N) = 1
    assert int(w.argmax()) == int((a * b).sum(1).argmin())   # the hardest positive weighs most


def test_dcl_refuses_bad_settings_and_a_batch_of_one():
    with pytest.raises(ValueError, match="temperature"):
        DCLLoss(0.0)
    with pytest.raises(ValueError, match="sigma"):
        DCLWLoss(0.1, sigma=0.0)
    with pytest.raises(ValueError, match="at least 2 samples"):
        DCLLoss()(_rand(1, 4), _rand(1, 4, seed=1))
    with pytest.raises(ValueError, match="one shape"):
        DCLLoss()(_rand(2, 4), _rand(3, 4, seed=1))
