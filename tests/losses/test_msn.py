"""MSNLoss against the paper's formula written out term by term, against Lightly 1.6.0's MSNLoss (1e-9, float64),
its gradients, and its half-precision guard. The W=2 exactness of ME-MAX's global mean is the method's check
(``unison check --method msn``, run for every method by tests/helpers/every_method.py)."""

from __future__ import annotations

import math

import pytest
import torch

from unison.losses import MSNLoss, sinkhorn_balance
from unison.losses.msn import sharpen


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs(views: int = 3, n: int = 6, d: int = 8, k: int = 10):
    return _rand(views * n, d, seed=1), _rand(n, d, seed=2), _rand(k, d, seed=3)


def _reference(anchors, targets, prototypes, tau=0.1, sharpen_t=0.25, iterations=3, weight=1.0):
    """The paper's loss, sample by sample: soft nearest-prototype predictions, sharpened Sinkhorn targets, ME-MAX."""
    unit = [row / row.norm() for row in prototypes]

    def predict(z):
        z = z / z.norm()
        sims = torch.stack([z @ c for c in unit]) / tau
        return sims.exp() / sims.exp().sum()

    n = targets.shape[0]
    targets_p = torch.stack([predict(t) ** (1 / sharpen_t) for t in targets])
    targets_p = targets_p / targets_p.sum(dim=1, keepdim=True)
    q = targets_p
    if iterations:                                 # Sinkhorn-Knopp as the official distributed_sinkhorn
        q = targets_p.T.clone()
        q /= q.sum()
        for _ in range(iterations):
            q /= q.sum(dim=1, keepdim=True) * q.shape[0]
            q /= q.sum(dim=0, keepdim=True) * n
        q = (q * n).T
    probs = [predict(a) for a in anchors]
    ce = sum(-(q[i % n] * p.log()).sum() for i, p in enumerate(probs)) / len(probs)
    mean = torch.stack(probs).mean(dim=0)
    me_max = sum(m * m.log() for m in mean) + math.log(len(mean))
    return ce + weight * me_max


@pytest.mark.parametrize("iterations", [0, 3])
def test_msn_loss_matches_the_formula(iterations):
    a, t, p = _inputs()
    got = MSNLoss(sinkhorn_iterations=iterations)(a, t, p, sharpen_temperature=0.25)
    torch.testing.assert_close(got, _reference(a, t, p, iterations=iterations), rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float64 and got.dim() == 0


@pytest.mark.parametrize("iterations, weight", [(3, 1.0), (0, 1.0), (3, 0.0), (5, 0.5)])
def test_msn_loss_equals_lightlys(iterations, weight):
    lightly = pytest.importorskip("lightly.loss")
    a, t, p = _inputs()
    ours = MSNLoss(temperature=0.1, sinkhorn_iterations=iterations, regularization_weight=weight)
    theirs = lightly.MSNLoss(temperature=0.1, sinkhorn_iterations=iterations, regularization_weight=weight)
    for sharpen_t in (0.25, 0.5):
        assert abs(float(ours(a, t, p, sharpen_t)) - float(theirs(a, t, p, sharpen_t))) < 1e-9


def test_msn_loss_gradients_equal_lightlys():
    lightly = pytest.importorskip("lightly.loss")
    grads = []
    for loss_fn in (MSNLoss(), lightly.MSNLoss()):
        a, t, p = (x.requires_grad_() for x in _inputs())
        loss_fn(a, t, p).backward()
        assert t.grad is None or not t.grad.any()           # the targets carry no gradient
        grads.append((a.grad, p.grad))
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_me_max_is_zero_for_a_uniform_mean_and_grows_with_collapse():
    loss_fn = MSNLoss()
    k = 8
    assert abs(float(loss_fn.regularizer(torch.full((k,), 1 / k, dtype=torch.float64)))) < 1e-15
    collapsed = torch.tensor([1.0] + [0.0] * (k - 1), dtype=torch.float64)
    assert float(loss_fn.regularizer(collapsed)) == pytest.approx(math.log(k))   # KL(one-hot || uniform)


def test_sinkhorn_balances_prototype_mass_and_keeps_rows_summing_to_one():
    p = sharpen(torch.softmax(_rand(12, 5), dim=1), 0.25)
    q = sinkhorn_balance(p, iterations=50)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(12, dtype=torch.float64))
    torch.testing.assert_close(q.sum(dim=0), torch.full((5,), 12 / 5, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_half_precision_inputs_run_in_float32():
    a, t, p = (x.to(torch.bfloat16) for x in _inputs())
    loss = MSNLoss()(a, t, p)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    full = MSNLoss()(*(x.float() for x in (a, t, p)))
    torch.testing.assert_close(loss, full)


def test_shapes_that_do_not_fit_are_refused():
    a, t, p = _inputs()
    with pytest.raises(ValueError, match="anchors"):
        MSNLoss()(a[:-1], t, p)          # not a whole number of views
    with pytest.raises(ValueError, match="anchors"):
        MSNLoss()(a, t, p[:, :-1])       # prototypes of another width
    with pytest.raises(ValueError, match="sharpen_temperature"):
        MSNLoss()(a, t, p, sharpen_temperature=0)
