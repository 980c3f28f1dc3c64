"""CAPILoss against the paper's formula written out position by position and token by token, against Lightly 1.6.0's
CAPILoss (1e-9, float64, values and gradients), its float32 exponent offset, its half-precision guard and its
one-line refusals. Its W=2 exactness: tests/methods/test_capi.py and ``unison check --method capi``."""

from __future__ import annotations

import pytest
import torch

from unison.losses import CAPILoss, positionwise_sinkhorn


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _inputs(n: int = 5, patches: int = 9, m: int = 4, k: int = 7, scale: float = 1.0):
    g = torch.Generator().manual_seed(3)
    predicted = torch.stack([torch.randperm(patches, generator=g)[:m].sort().values for _ in range(n)])
    return _rand(n, patches, k, seed=1, scale=scale), _rand(n, m, k, seed=2, scale=scale), predicted


def _reference(teacher, student, predicted, tau_t=0.06, tau_s=0.12, tau_c=0.12, iterations=3):
    """The official OnlineClustering and student loss, one position and one token at a time."""
    n, patches, k = teacher.shape
    q = torch.empty_like(teacher)
    for j in range(patches):                       # positionwise: each position's [n, K] on its own
        scaled = teacher[:, j] / tau_t
        m = (scaled - scaled.max(dim=0).values).exp()      # each cluster from its maximum over the batch
        for _ in range(iterations):
            m = m / (m.sum(dim=0, keepdim=True) + 1e-8)     # every cluster: the same mass over the batch
            m = m / (m.sum(dim=1, keepdim=True) + 1e-8)     # every token: a distribution over the clusters
        q[:, j] = m

    def ce(target, logits, tau):
        return -(target * (logits / tau).log_softmax(dim=-1)).sum()

    capi = sum(ce(q[b, predicted[b, i]], student[b, i], tau_s) for b in range(n) for i in range(predicted.shape[1]))
    clust = sum(ce(q[b, j], teacher[b, j], tau_c) for b in range(n) for j in range(patches))
    return capi / predicted.numel(), clust / (n * patches)


@pytest.mark.parametrize("iterations", [1, 3, 5])
def test_capi_loss_matches_the_formula(iterations):
    t, s, p = _inputs()
    got = CAPILoss(sinkhorn_iterations=iterations)(t, s, p)
    want = _reference(t, s, p, iterations=iterations)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert g.dtype == torch.float64 and g.dim() == 0


def test_the_targets_balance_every_position_over_the_batch():
    q = positionwise_sinkhorn(_rand(6, 5, 4, seed=4), iterations=50)
    torch.testing.assert_close(q.sum(dim=-1), torch.ones(6, 5, dtype=torch.float64))          # rows: distributions
    torch.testing.assert_close(q.sum(dim=0), torch.full((5, 4), 6 / 4, dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("temps", [(0.06, 0.12, 0.12), (0.1, 0.2, 0.05)])
@pytest.mark.parametrize("iterations", [1, 3])
def test_capi_loss_equals_lightlys(temps, iterations):
    """Lightly's CAPILoss(teacher, student, teacher_index) is L_capi, CAPILoss(teacher, teacher) L_clust; Lightly
    takes one student temperature for both (its clustering loss is the same call), so L_clust is compared at
    clustering_temp = student_temp."""
    from lightly.loss import CAPILoss as LightlyCAPILoss

    tau_t, tau_s, tau_c = temps
    ours = CAPILoss(tau_t, tau_s, tau_c, iterations)
    theirs = LightlyCAPILoss(teacher_temperature=tau_t, student_temperature=tau_s, sinkhorn_iterations=iterations)
    theirs_c = LightlyCAPILoss(teacher_temperature=tau_t, student_temperature=tau_c, sinkhorn_iterations=iterations)
    t, s, p = _inputs(scale=3.0)
    grads = []
    for fn in (lambda a, b: ours(a, b, p), lambda a, b: (theirs(a, b, p), theirs_c(a, a))):
        a, b = t.clone().requires_grad_(True), s.clone().requires_grad_(True)
        capi, clust = fn(a, b)
        (capi + 2 * clust).backward()
        grads.append((capi.detach(), clust.detach(), a.grad, b.grad))
    for mine, lightly in zip(*grads):
        torch.testing.assert_close(mine, lightly, rtol=1e-9, atol=1e-9)


def test_gradients_reach_each_loss_own_input_only():
    t, s, p = _inputs()
    t.requires_grad_(True)
    s.requires_grad_(True)
    capi, clust = CAPILoss()(t, s, p)
    for loss, other in ((capi, t), (clust, s)):   # the targets carry no gradient
        grad = torch.autograd.grad(loss, other, retain_graph=True, allow_unused=True)[0]
        assert grad is None or not grad.any()
    assert torch.autograd.grad(capi, s, retain_graph=True)[0].abs().sum() > 0
    assert torch.autograd.grad(clust, t)[0].abs().sum() > 0


def test_float32_targets_equal_float64s():
    """float32 exponentiates from e^50 below each column's maximum (the official offset), float64 from 1: the offset
    cancels but for the 1e-8 of the first division, so the two agree to float32's precision on spread-out logits."""
    logits = _rand(8, 6, 5, seed=5, scale=40.0)
    want = positionwise_sinkhorn(logits)
    got = positionwise_sinkhorn(logits.float())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_half_precision_logits_run_in_float32():
    t, s, p = _inputs()
    for dtype in (torch.float16, torch.bfloat16):
        got = CAPILoss()(t.to(dtype), s.to(dtype), p)
        assert all(g.dtype == torch.float32 for g in got)
        for g, want in zip(got, CAPILoss()(t.to(dtype).double(), s.to(dtype).double(), p)):
            torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-5)   # the rounded inputs, in float32


def test_bad_inputs_are_one_line():
    t, s, p = _inputs()
    with pytest.raises(ValueError, match=r"expected teacher logits \[n, N, K\]"):
        CAPILoss()(t[0], s, p)
    with pytest.raises(ValueError, match="expected teacher logits"):
        CAPILoss()(t, s[:, :, :3], p)
    with pytest.raises(ValueError, match="int64"):
        CAPILoss()(t, s, p.int())
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        CAPILoss(teacher_temp=0.0)
    with pytest.raises(ValueError, match="sinkhorn_iterations"):
        CAPILoss(sinkhorn_iterations=0)
