"""Each loss against a direct, loop-level restatement of its formula (single process, float64)."""

import math

import pytest
import torch

from unison.losses import BarlowTwinsLoss, BYOLLoss, DINOLoss, MoCoLoss, SimSiamLoss, SwAVLoss, VICRegLoss, sinkhorn


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _unit(v):
    return v / v.norm()


def _cos(u, v):
    return float((u @ v) / (u.norm() * v.norm()))


def _close(a, b, tol=1e-10):
    a, b = float(a), float(b)
    assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)


def _grads_match(fn_a, fn_b, *inputs):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    ys = [x.clone().requires_grad_(True) for x in inputs]
    fn_a(*xs).backward()
    fn_b(*ys).backward()
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------- MoCo
def test_moco_loss():
    n, d, k, t = 5, 4, 7, 0.2
    q, key, queue = _rand(n, d, seed=1), _rand(n, d, seed=2), _rand(k, d, seed=3)
    queue = queue / queue.norm(dim=1, keepdim=True)
    expected = 0.0
    for i in range(n):
        qi, ki = _unit(q[i]), _unit(key[i])
        pos = math.exp(float(qi @ ki) / t)
        neg = sum(math.exp(float(qi @ queue[j]) / t) for j in range(k))
        expected += -math.log(pos / (pos + neg))
    _close(MoCoLoss(t)(q, key, queue), expected / n)


def test_moco_loss_has_no_gradient_through_keys_or_queue():
    q, key, queue = _rand(3, 4, seed=1).requires_grad_(), _rand(3, 4, seed=2).requires_grad_(), _rand(5, 4, seed=3)
    MoCoLoss(0.1)(q, key, queue).backward()
    assert q.grad is not None and key.grad is None


# ---------------------------------------------------------------------------------- BYOL / SimSiam
def test_byol_loss():
    n, d = 6, 5
    p_a, p_b, z_a, z_b = (_rand(n, d, seed=s) for s in range(4))
    expected = 0.0
    for i in range(n):
        expected += ((_unit(p_a[i]) - _unit(z_b[i])) ** 2).sum() + ((_unit(p_b[i]) - _unit(z_a[i])) ** 2).sum()
    _close(BYOLLoss()(p_a, p_b, z_a, z_b), expected / (2 * n))
    for i in range(n):   # ||p/|p| - z/|z|||^2 == 2 - 2 cos
        _close(((_unit(p_a[i]) - _unit(z_b[i])) ** 2).sum(), 2 - 2 * _cos(p_a[i], z_b[i]))


def test_simsiam_loss_and_stop_gradient():
    n, d = 6, 5
    p_a, p_b, z_a, z_b = (_rand(n, d, seed=s) for s in range(4))
    expected = sum(-_cos(p_a[i], z_b[i]) / 2 - _cos(p_b[i], z_a[i]) / 2 for i in range(n)) / n
    _close(SimSiamLoss()(p_a, p_b, z_a, z_b), expected)
    z = z_a.clone().requires_grad_()
    p = p_a.clone().requires_grad_()
    SimSiamLoss()(p, p_b, z, z_b).backward()
    assert p.grad is not None and z.grad is None


# ---------------------------------------------------------------------------------- Barlow Twins
def _barlow_reference(z_a, z_b, lam, eps=1e-5):
    n, d = z_a.shape

    def standardise(z):
        cols = []
        for j in range(d):
            col = z[:, j]
            mean = col.sum() / n
            var = ((col - mean) ** 2).sum() / n
            cols.append((col - mean) / torch.sqrt(var + eps))
        return torch.stack(cols, dim=1)

    a, b = standardise(z_a), standardise(z_b)
    loss = 0.0
    for i in range(d):
        for j in range(d):
            c_ij = sum(a[s, i] * b[s, j] for s in range(n)) / n
            loss = loss + ((1 - c_ij) ** 2 if i == j else lam * c_ij ** 2)
    return loss


def test_barlow_twins_loss_value_and_gradient():
    z_a, z_b = _rand(7, 4, seed=1) * 2 + 1, _rand(7, 4, seed=2)
    lam = 0.3
    _close(BarlowTwinsLoss(lam)(z_a, z_b), _barlow_reference(z_a, z_b, lam))
    _grads_match(BarlowTwinsLoss(lam), lambda a, b: _barlow_reference(a, b, lam), z_a, z_b)


# ---------------------------------------------------------------------------------- VICReg
def _vicreg_reference(z_a, z_b, lam=25.0, mu=25.0, nu=1.0, gamma=1.0, eps=1e-4):
    n, d = z_a.shape
    inv = sum(((z_a[i] - z_b[i]) ** 2).sum() for i in range(n)) / (n * d)

    def variance(z):
        total = 0.0
        for j in range(d):
            mean = z[:, j].sum() / n
            var = ((z[:, j] - mean) ** 2).sum() / (n - 1)
            total = total + torch.clamp(gamma - torch.sqrt(var + eps), min=0)
        return total / d

    def covariance(z):
        means = [z[:, j].sum() / n for j in range(d)]
        total = 0.0
        for j in range(d):
            for k in range(d):
                if j != k:
                    c = sum((z[i, j] - means[j]) * (z[i, k] - means[k]) for i in range(n)) / (n - 1)
                    total = total + c ** 2
        return total / d

    return lam * inv + mu * (variance(z_a) + variance(z_b)) / 2 + nu * (covariance(z_a) + covariance(z_b))


def test_vicreg_loss_value_and_gradient():
    z_a, z_b = _rand(6, 4, seed=1) * 0.5, _rand(6, 4, seed=2) * 1.5   # some stds below gamma, some above
    _close(VICRegLoss()(z_a, z_b), _vicreg_reference(z_a, z_b))
    _grads_match(VICRegLoss(), _vicreg_reference, z_a, z_b)


# ---------------------------------------------------------------------------------- SwAV
def _sinkhorn_reference(scores, eps, iters):
    b, k = scores.shape
    q = [[math.exp(float(scores[i, j]) / eps) for i in range(b)] for j in range(k)]   # [K][B]
    total = sum(sum(row) for row in q)
    q = [[x / total for x in row] for row in q]
    for _ in range(iters):
        q = [[x / sum(row) / k for x in row] for row in q]
        col = [sum(q[j][i] for j in range(k)) for i in range(b)]
        q = [[q[j][i] / col[i] / b for i in range(b)] for j in range(k)]
    return torch.tensor([[q[j][i] * b for j in range(k)] for i in range(b)], dtype=torch.float64)


def test_sinkhorn_matches_reference_and_is_an_assignment():
    s = torch.nn.functional.normalize(_rand(6, 4, seed=1), dim=1) @ torch.nn.functional.normalize(
        _rand(5, 4, seed=2), dim=1).T                                      # [6 samples, 5 prototypes]
    q = sinkhorn(s, epsilon=0.05, iterations=3)
    torch.testing.assert_close(q, _sinkhorn_reference(s, 0.05, 3), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(q.sum(dim=1), torch.ones(6, dtype=torch.float64))
    q32 = sinkhorn(s.float(), epsilon=0.05, iterations=3, float64=True)
    assert q32.dtype == torch.float32
    torch.testing.assert_close(q32, q.float())


def test_sinkhorn_guards_zero_rows():
    s = torch.zeros(4, 3)
    s[:, 2] = -100.0                       # prototype 2 underflows to exactly 0 in float64 exp(-2000)
    q = sinkhorn(s, epsilon=0.05, iterations=3)
    assert torch.isfinite(q).all() and (q[:, 2] == 0).all()
    torch.testing.assert_close(q.sum(dim=1), torch.ones(4))


def test_swav_loss_with_local_crops_and_queue():
    n, k, t, eps = 4, 5, 0.1, 0.05
    crops = [torch.tanh(_rand(n, k, seed=s)) for s in range(4)]         # 2 global + 2 local crops
    queue = [torch.tanh(_rand(3, k, seed=10 + i)) for i in range(2)]
    for qs in (None, queue):
        expected = 0.0
        for i in range(2):
            cols = crops[i] if qs is None else torch.cat([qs[i], crops[i]])
            codes = _sinkhorn_reference(cols, eps, 3)[-n:]
            sub = 0.0
            for v in range(4):
                if v == i:
                    continue
                for b in range(n):
                    logits = [float(crops[v][b, j]) / t for j in range(k)]
                    lse = math.log(sum(math.exp(x) for x in logits))
                    sub += -sum(float(codes[b, j]) * (logits[j] - lse) for j in range(k)) / n
            expected += sub / 3
        _close(SwAVLoss(t, eps, 3)(crops, qs), expected / 2)


def test_swav_codes_carry_no_gradient():
    crops = [_rand(4, 5, seed=s).requires_grad_() for s in range(2)]
    SwAVLoss()(crops).backward()
    assert all(c.grad is not None for c in crops)  # through the predictions only
    q = SwAVLoss().codes(crops[0])
    assert not q.requires_grad


# ---------------------------------------------------------------------------------- DINO
def test_dino_loss_and_centre_update():
    n, d, ts, tt, m = 3, 6, 0.1, 0.04, 0.9
    student = [_rand(n, d, seed=s) for s in range(4)]     # 2 global + 2 local
    teacher = [_rand(n, d, seed=10 + s) for s in range(2)]
    loss_fn = DINOLoss(d, student_temp=ts, center_momentum=m).double()
    loss_fn.center.copy_(_rand(1, d, seed=20))
    old_centre = loss_fn.center.clone()

    def softmax(v):
        e = [math.exp(x) for x in v]
        return [x / sum(e) for x in e]

    total, pairs = 0.0, 0
    for i in range(2):
        for v in range(4):
            if v == i:
                continue
            for b in range(n):
                p_t = softmax([(float(teacher[i][b, j]) - float(old_centre[0, j])) / tt for j in range(d)])
                p_s = softmax([float(student[v][b, j]) / ts for j in range(d)])
                total += -sum(p_t[j] * math.log(p_s[j]) for j in range(d)) / n
            pairs += 1
    _close(loss_fn(student, teacher, teacher_temp=tt), total / pairs)
    batch_mean = torch.cat(teacher).mean(dim=0, keepdim=True)
    torch.testing.assert_close(loss_fn.center, m * old_centre + (1 - m) * batch_mean)
    loss_fn.eval()
    loss_fn(student, teacher, teacher_temp=tt)
    torch.testing.assert_close(loss_fn.center, m * old_centre + (1 - m) * batch_mean)   # eval: unchanged


def test_dino_centre_is_persistent_and_rank_local():
    from unison.distributed.tagging import rank_local_state_names

    loss_fn = DINOLoss(8)
    assert "center" in loss_fn.state_dict()
    assert rank_local_state_names(loss_fn) == ["center"]


@pytest.mark.parametrize("bad", [lambda: MoCoLoss(0.0), lambda: SwAVLoss(temperature=-1), lambda: DINOLoss(4, 0.0)])
def test_invalid_temperatures_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_barlow_and_vicreg_run_in_float32_under_autocast():
    z_a, z_b = _rand(8, 4, seed=1).float(), _rand(8, 4, seed=2).float()
    for loss_fn in (BarlowTwinsLoss(), VICRegLoss()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = loss_fn(z_a.bfloat16(), z_b.bfloat16())
        assert low.dtype == torch.float32
        torch.testing.assert_close(low, loss_fn(z_a.bfloat16().float(), z_b.bfloat16().float()))


def test_ntxent_runs_in_float32_under_bf16_autocast():
    """In bf16 the similarities are rounded to 1/128 before the division by T; the loss upcasts instead."""
    from unison.losses import NTXentLoss

    g = torch.Generator().manual_seed(0)
    z_a = torch.randn(256, 128, generator=g)
    z_b = z_a + 0.3 * torch.randn(256, 128, generator=g)
    loss_fn = NTXentLoss(temperature=0.2, gather_distributed=False)
    exact = loss_fn(z_a, z_b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = loss_fn(z_a, z_b)
        from_bf16 = loss_fn(z_a.bfloat16(), z_b.bfloat16())   # what a projector under autocast hands over
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, exact)
    assert torch.equal(from_bf16, loss_fn(z_a.bfloat16().float(), z_b.bfloat16().float()))
