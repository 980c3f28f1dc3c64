"""The losses of the ViT-era methods against direct, unbatched implementations of the papers' formulas.

Each reference below loops over samples / patches / directions and writes the paper's
formula term by term (float64, small inputs), so a batching or normalisation mistake in the
vectorised loss shows as a mismatch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from unison.losses import (
    IBOTLoss,
    IJEPALoss,
    KoLeoLoss,
    LeJEPALoss,
    MAELoss,
    MoCoV3Loss,
    SIGRegLoss,
    patchify,
    sigreg_directions,
)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------------------ MAE
def test_patchify_order():
    img = _rand(2, 3, 8, 8)           # float64 throughout
    p = patchify(img, 4)
    assert p.shape == (2, 4, 48)
    for b in range(2):
        for r in range(2):
            for c in range(2):
                expect = [img[b, ch, 4 * r + i, 4 * c + j] for i in range(4) for j in range(4) for ch in range(3)]
                torch.testing.assert_close(p[b, 2 * r + c], torch.stack(expect))


@pytest.mark.parametrize("norm_pix", [True, False])
def test_mae_loss_matches_the_formula(norm_pix):
    n, m, P = 3, 5, 12
    pred, target = _rand(n, m, P, seed=1), _rand(n, m, P, seed=2)
    total = 0.0
    for i in range(n):
        per_sample = 0.0
        for j in range(m):
            t = target[i, j].tolist()
            if norm_pix:
                mean = sum(t) / P
                var = sum((x - mean) ** 2 for x in t) / (P - 1)
                t = [(x - mean) / math.sqrt(var + 1e-6) for x in t]
            per_sample += sum((pred[i, j, k].item() - t[k]) ** 2 for k in range(P)) / P
        total += per_sample / m
    assert MAELoss(norm_pix=norm_pix)(pred, target).item() == pytest.approx(total / n, rel=1e-12)


# ------------------------------------------------------------------------------ MoCo v3
def test_mocov3_loss_matches_the_formula():
    n, d, T = 6, 5, 0.2
    q, k = _rand(n, d, seed=3), _rand(n, d, seed=4)
    qn, kn = F.normalize(q, dim=1), F.normalize(k, dim=1)
    ref = 0.0
    for i in range(n):
        logits = [float(qn[i] @ kn[j]) / T for j in range(n)]
        ref += -(logits[i] - math.log(sum(math.exp(x) for x in logits)))
    assert MoCoV3Loss(T)(q, k).item() == pytest.approx(2 * T * ref / n, rel=1e-12)


# ------------------------------------------------------------------------------ KoLeo
def test_koleo_loss_matches_the_formula():
    n, d = 7, 4
    x = _rand(n, d, seed=5)
    xn = [v / v.norm() for v in x]
    ref = 0.0
    for i in range(n):
        nearest = min(float((xn[i] - xn[j]).norm()) for j in range(n) if j != i)
        ref += -math.log(nearest)
    assert KoLeoLoss()(x).item() == pytest.approx(ref / n, rel=1e-6)     # eps = 1e-8 inside the norm and the log


# ------------------------------------------------------------------------------ I-JEPA
def test_ijepa_loss_matches_the_formula():
    n, M, K, D = 2, 3, 4, 5
    pred, target = _rand(n, M, K, D, seed=6), _rand(n, M, K, D, seed=7)
    ref = sum(sum(sum(float(((pred[i, b, j] - target[i, b, j]) ** 2).sum()) for j in range(K)) / K
                  for b in range(M)) / M for i in range(n)) / n
    assert IJEPALoss()(pred, target).item() == pytest.approx(ref, rel=1e-12)


# ------------------------------------------------------------------------------ LeJEPA / SIGReg
def _epps_pulley(samples: list[float]) -> float:
    """N * integral |phi_N(t) - exp(-t^2/2)|^2 exp(-t^2/2) dt, trapezoid on 17 points of [-5, 5]."""
    t = torch.linspace(-5, 5, 17, dtype=torch.float64)
    errs = []
    for tk in t.tolist():
        ecf = sum(complex(math.cos(tk * x), math.sin(tk * x)) for x in samples) / len(samples)
        phi = math.exp(-tk * tk / 2)
        errs.append(abs(ecf - phi) ** 2 * phi)
    return len(samples) * float(torch.trapezoid(torch.tensor(errs, dtype=torch.float64), t))


def test_sigreg_matches_the_epps_pulley_formula():
    V, n, K, M = 2, 9, 4, 3
    z = _rand(V, n, K, seed=8)
    a = sigreg_directions(seed=1, step=3, dim=K, num_slices=M, dtype=torch.float64)
    ref = sum(_epps_pulley([float(z[v, i] @ a[:, m]) for i in range(n)]) for v in range(V) for m in range(M)) / (V * M)
    assert SIGRegLoss()(z, a).item() == pytest.approx(ref, rel=1e-10)


def test_lejepa_loss_matches_the_formula():
    V, n, K, M, lambd = 3, 5, 4, 2, 0.3
    z = _rand(V, n, K, seed=9)
    a = sigreg_directions(seed=0, step=0, dim=K, num_slices=M, dtype=torch.float64)
    pred = 0.0
    for v in range(V):
        for i in range(n):
            centre = (z[0, i] + z[1, i]) / 2                      # two global views
            pred += sum((centre[k].item() - z[v, i, k].item()) ** 2 for k in range(K))
    pred /= V * n * K
    sig = sum(_epps_pulley([float(z[v, i] @ a[:, m]) for i in range(n)]) for v in range(V) for m in range(M)) / (V * M)
    got = LeJEPALoss(lambd)(z, n_global=2, directions=a).item()
    assert got == pytest.approx((1 - lambd) * pred + lambd * sig, rel=1e-10)


def test_sigreg_is_small_for_gaussian_samples_and_large_for_collapse():
    a = sigreg_directions(seed=0, step=0, dim=8, num_slices=16, dtype=torch.float64)
    gaussian = SIGRegLoss()(_rand(1, 2000, 8, seed=10), a).item()
    collapsed = SIGRegLoss()(0.01 * _rand(1, 2000, 8, seed=11), a).item()
    assert gaussian < 1.0 < 100 * gaussian < collapsed


def test_sigreg_directions_are_unit_and_a_function_of_seed_and_step():
    a = sigreg_directions(seed=0, step=5, dim=16, num_slices=32)
    torch.testing.assert_close(a.norm(dim=0), torch.ones(32))
    torch.testing.assert_close(a, sigreg_directions(seed=0, step=5, dim=16, num_slices=32), rtol=0, atol=0)
    assert not torch.equal(a, sigreg_directions(seed=0, step=6, dim=16, num_slices=32))
    assert not torch.equal(a, sigreg_directions(seed=1, step=5, dim=16, num_slices=32))


# ------------------------------------------------------------------------------ iBOT
def _cross_entropy(p: list[float], logits: list[float], temp: float) -> float:
    z = [x / temp for x in logits]
    log_norm = math.log(sum(math.exp(x) for x in z))
    return -sum(pi * (zi - log_norm) for pi, zi in zip(p, z))


def _softmax(x: list[float]) -> list[float]:
    e = [math.exp(v) for v in x]
    return [v / sum(e) for v in e]


def _sinkhorn_reference(scores: torch.Tensor, eps: float, iterations: int) -> torch.Tensor:
    """DINOv2's sinkhorn_knopp_teacher, one process, written out with explicit sums."""
    q = torch.exp(scores / eps).T.clone()                       # [K, B]
    K, B = q.shape
    q /= q.sum()
    for _ in range(iterations):
        for r in range(K):
            q[r] /= q[r].sum() * K
        for c in range(B):
            q[:, c] /= q[:, c].sum() * B
    return (q * B).T


@pytest.mark.parametrize("centering", ["centre", "sinkhorn"])
def test_ibot_loss_matches_the_formula(centering):
    n, m, K, tt, ts = 3, 2, 5, 0.04, 0.1
    s_cls = [_rand(n, K, seed=20 + v) for v in range(4)]            # 2 global + 2 local student crops
    t_cls = [_rand(n, K, seed=30 + i) for i in range(2)]
    s_patch = [_rand(n, m, K, seed=40 + i) for i in range(2)]
    t_patch = [_rand(n, m, K, seed=50 + i) for i in range(2)]
    loss_fn = IBOTLoss(K, student_temp=ts, centering=centering).double()
    c_cls, c_patch = _rand(1, K, seed=60), _rand(1, K, seed=61)
    loss_fn.center.copy_(c_cls)
    loss_fn.patch_center.copy_(c_patch)
    got_cls, got_patch = loss_fn(s_cls, t_cls, s_patch, t_patch, teacher_temp=tt)

    if centering == "sinkhorn":
        p_cls = _sinkhorn_reference(torch.cat(t_cls), tt, 3).split(n)
        p_patch = _sinkhorn_reference(torch.cat([t.reshape(n * m, K) for t in t_patch]), tt, 3).split(n * m)
        p_cls_of = lambda i, b: p_cls[i][b].tolist()                                   # noqa: E731
        p_patch_of = lambda i, b, j: p_patch[i][b * m + j].tolist()                    # noqa: E731
    else:
        p_cls_of = lambda i, b: _softmax([(x - c) / tt for x, c in zip(t_cls[i][b].tolist(), c_cls[0].tolist())])  # noqa: E731
        p_patch_of = lambda i, b, j: _softmax([(x - c) / tt for x, c in                                         # noqa: E731
                                               zip(t_patch[i][b, j].tolist(), c_patch[0].tolist())])
    pairs = [(i, v) for i in range(2) for v in range(4) if v != i]
    ref_cls = sum(sum(_cross_entropy(p_cls_of(i, b), s_cls[v][b].tolist(), ts) for b in range(n)) / n
                  for i, v in pairs) / len(pairs)
    ref_patch = sum(sum(sum(_cross_entropy(p_patch_of(i, b, j), s_patch[i][b, j].tolist(), ts) for j in range(m)) / m
                        for b in range(n)) / n for i in range(2)) / 2
    assert got_cls.item() == pytest.approx(ref_cls, rel=1e-10)
    assert got_patch.item() == pytest.approx(ref_patch, rel=1e-10)
    if centering == "centre":          # centres move towards the batch means, from the old centre
        mean_cls = torch.cat(t_cls).mean(0, keepdim=True)
        torch.testing.assert_close(loss_fn.center, 0.9 * c_cls + 0.1 * mean_cls)
        mean_patch = torch.cat([t.reshape(n * m, K) for t in t_patch]).mean(0, keepdim=True)
        torch.testing.assert_close(loss_fn.patch_center, 0.9 * c_patch + 0.1 * mean_patch)
