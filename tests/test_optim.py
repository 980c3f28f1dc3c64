"""Distributed optimizers: real gloo processes, different data on each rank, float64.

One 2-process launch (module fixture `workers`) runs every distributed scenario; the
references and the single-process tests run in the test process.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from unison.distributed import collectives as C
from unison.distributed.optim import LARS, GradientAveragingOptimizer, LocalSGD, ShardedOptimizer, build_optimizer
from unison.distributed.testing import run_in_workers

DIM = 6
_g = torch.Generator().manual_seed(123)
X = torch.randn(8, DIM, generator=_g, dtype=torch.float64)  # global batch: rows 0-3 rank 0, rows 4-7 rank 1
Y = torch.randn(8, DIM, generator=_g, dtype=torch.float64)
STEPS = 3
HYPER = {"sgd": dict(lr=0.1, weight_decay=0.1), "adamw": dict(lr=0.05, weight_decay=0.1),
         "lars": dict(lr=2.0, weight_decay=0.1)}


class Net(nn.Module):
    """Four equal Linear layers, plus `extra` (used only by rank 1's loss) and `unused` (never used)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(4):
            layers += [nn.Linear(DIM, DIM, dtype=torch.float64)] + ([nn.Tanh()] if i < 3 else [])
        self.body = nn.Sequential(*layers)
        self.extra = nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
        self.unused = nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
        g = torch.Generator().manual_seed(7)  # identical start on every rank, whatever torch's seed
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)


def body_loss(net: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net.body(x) - y) ** 2).sum(1).mean()  # mean over the rows given


def extra_term(net: Net, x: torch.Tensor) -> torch.Tensor:
    return (net.extra * x.mean(0)).sum()


def local_loss(net: Net, use_extra: bool = True) -> torch.Tensor:
    rows = C.local_slice(X.shape[0])
    loss = body_loss(net, X[rows], Y[rows])
    return loss + extra_term(net, X[rows]) if use_extra and C.rank() == 1 else loss


def global_loss(net: Net, use_extra: bool = True) -> torch.Tensor:
    # Mean of the ranks' local losses: body over the whole batch, `extra` from rank 1 only.
    loss = body_loss(net, X, Y)
    return loss + 0.5 * extra_term(net, X[4:]) if use_extra else loss


def vec(net: nn.Module) -> torch.Tensor:
    return parameters_to_vector(net.parameters()).detach().clone()


def train(net: Net, opt, steps: int, loss_fn=local_loss) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(net).backward()
        opt.step()


# ------------------------------- distributed part 1: gradient averaging, state sync, LocalSGD
def _averaging_worker():
    out = {}
    for name, hp in HYPER.items():
        net = Net()
        opt = GradientAveragingOptimizer(build_optimizer(name, net.parameters(), **hp))
        train(net, opt, STEPS)
        out[name] = vec(net)
        out[name + "_unused_grad_is_none"] = net.unused.grad is None

    # synchronize_optimizer_state: diverge rank 1's state (buffers, step counter, missing entry, lr).
    net = Net()
    opt = GradientAveragingOptimizer(torch.optim.AdamW(net.parameters(), lr=0.05))
    train(net, opt, 2)
    if C.rank() == 1:
        for p in net.parameters():
            if p.grad is not None:
                p.grad.mul_(3.0)
        opt.optimizer.step()  # local, un-averaged step
        del opt.optimizer.state[net.extra]  # parameter index 0 (own parameters come first)
        opt.param_groups[0]["lr"] = 0.123
    for p in net.parameters():
        C.broadcast_(p.data)  # realign the parameters; only the state stays diverged
    out["sync_before"] = copy.deepcopy(opt.state_dict())
    opt.synchronize_optimizer_state()
    out["sync_after"] = copy.deepcopy(opt.state_dict())
    train(net, opt, 1)
    out["sync_next"] = vec(net)

    # LocalSGD: 2 warm-up steps (gradient averaging), then local steps, averaging every 3rd.
    net = Net()
    lsgd = LocalSGD(build_optimizer("sgd", net.parameters(), lr=0.1, weight_decay=0.0), period=3, warmup_steps=2)
    trace = []
    for _ in range(5):
        train(net, lsgd, 1, loss_fn=lambda n: local_loss(n, use_extra=False))
        trace.append(vec(net))
    out["local_sgd"] = torch.stack(trace)
    out["local_sgd_step"] = lsgd.state_dict()["local_sgd_step"]
    return out


def _worker():
    # One launch for everything: most of a launch is the workers importing torch.
    return {"averaging": _averaging_worker(), "sharded": _sharded_worker()}


@pytest.fixture(scope="module")
def workers():
    return run_in_workers(_worker, world_size=2)


@pytest.fixture
def averaging(workers):
    return [w["averaging"] for w in workers]


@pytest.mark.parametrize("name", list(HYPER))
def test_gradient_averaging_equals_global_batch_step(averaging, name):
    net = Net()
    start = vec(net)
    train(net, build_optimizer(name, net.parameters(), **HYPER[name]), STEPS, loss_fn=global_loss)
    r0, r1 = averaging[0][name], averaging[1][name]
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)  # bit-identical replicas
    torch.testing.assert_close(r0, vec(net), rtol=1e-10, atol=1e-10)
    assert (r0 - start).abs().max() > 1e-3  # the test is not vacuous
    # `unused` has no grad anywhere: it must stay None (zeros would let weight decay move it)
    assert averaging[0][name + "_unused_grad_is_none"] and averaging[1][name + "_unused_grad_is_none"]


def test_synchronize_optimizer_state(averaging):
    before0, after0, after1 = averaging[0]["sync_before"], averaging[0]["sync_after"], averaging[1]["sync_after"]
    before1 = averaging[1]["sync_before"]
    assert before1["param_groups"][0]["lr"] == 0.123 and 0 not in before1["state"]  # really diverged
    for sd in (after0, after1):
        torch.testing.assert_close(sd, before0, rtol=0, atol=0)  # rank 0 unchanged, rank 1 = rank 0
    assert after1["state"][2]["step"].item() == 2.0  # body[0].weight
    torch.testing.assert_close(averaging[0]["sync_next"], averaging[1]["sync_next"], rtol=0, atol=0)


def test_local_sgd_averages_every_period(averaging):
    t0, t1 = averaging[0]["local_sgd"], averaging[1]["local_sgd"]
    assert averaging[0]["local_sgd_step"] == 5
    # Reference: warm-up on the global batch, then each rank's own trajectory, then the mean.
    net = Net()
    opt = build_optimizer("sgd", net.parameters(), lr=0.1, weight_decay=0.0)
    expected = []
    for _ in range(2):
        train(net, opt, 1, loss_fn=lambda n: global_loss(n, use_extra=False))
        expected.append(vec(net))
    ends = []
    for rows in (slice(0, 4), slice(4, 8)):
        n_r, o_r = copy.deepcopy((net, opt))  # keeps the optimizer bound to the copied parameters
        train(n_r, o_r, 3, loss_fn=lambda n, rows=rows: body_loss(n, X[rows], Y[rows]))
        ends.append(vec(n_r))
    for i in (0, 1):  # warm-up: identical and equal to the global-batch step
        torch.testing.assert_close(t0[i], t1[i], rtol=0, atol=0)
        torch.testing.assert_close(t0[i], expected[i], rtol=1e-10, atol=1e-10)
    for i in (2, 3):  # local steps on different data: replicas drift
        assert (t0[i] - t1[i]).abs().max() > 1e-4
    torch.testing.assert_close(t0[4], t1[4], rtol=0, atol=0)
    torch.testing.assert_close(t0[4], (ends[0] + ends[1]) / 2, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------- distributed part 2: ZeRO sharding
ADAMW = dict(lr=0.05, weight_decay=0.01)


def _sharded_worker():
    body_only = lambda n: local_loss(n, use_extra=False)  # noqa: E731
    out = {}
    a, b = Net(), Net()  # only `body` (four equally sized layers) is optimised
    sharded = ShardedOptimizer(a.body.parameters(), torch.optim.AdamW, average_gradients=True, **ADAMW)
    plain = GradientAveragingOptimizer(torch.optim.AdamW(b.body.parameters(), **ADAMW))
    train(a, sharded, STEPS, body_only)
    train(b, plain, STEPS, body_only)
    out.update(sharded_bytes=sharded.local_state_bytes(), full_bytes=plain.local_state_bytes(),
               sharding=sharded.sharding, params_a=vec(a.body), params_b=vec(b.body),
               state=copy.deepcopy(sharded.state_dict()), plain_state=copy.deepcopy(plain.state_dict()))
    train(a, sharded, 1, body_only)
    train(b, plain, 1, body_only)
    out.update(next_a=vec(a.body), next_b=vec(b.body))

    # LARS through ZeRO, and hyperparameter sync.
    c, d = Net(), Net()
    sharded = ShardedOptimizer(c.body.parameters(), LARS, average_gradients=True, lr=2.0, weight_decay=0.1)
    plain = GradientAveragingOptimizer(LARS(d.body.parameters(), lr=2.0, weight_decay=0.1))
    train(c, sharded, STEPS, body_only)
    train(d, plain, STEPS, body_only)
    out.update(lars_a=vec(c.body), lars_b=vec(d.body))
    if C.rank() == 1:
        sharded.param_groups[0]["lr"] = 9.0
    sharded.synchronize_optimizer_state()
    out["lr_after_sync"] = sharded.param_groups[0]["lr"]
    return out


@pytest.fixture
def sharded(workers):
    return [w["sharded"] for w in workers]


def test_sharded_state_is_split(sharded):
    full = sharded[0]["full_bytes"]
    assert full == 2 * 4 * (DIM * DIM + DIM) * 8 + 8 * 4  # exp_avg + exp_avg_sq (float64) + 8 float32 steps
    for r in (0, 1):
        assert abs(sharded[r]["sharded_bytes"] - full / 2) <= 0.35 * full / 2
    assert sharded[0]["sharded_bytes"] + sharded[1]["sharded_bytes"] == full
    s = sharded[0]["sharding"]
    assert s == sharded[1]["sharding"] and s["world_size"] == 2
    assert sorted(s["params_per_rank"][0] + s["params_per_rank"][1]) == list(range(8))
    assert s["numel_per_rank"] == [84, 84]


def test_sharded_matches_unsharded(sharded):
    for r in (0, 1):
        torch.testing.assert_close(sharded[r]["params_a"], sharded[r]["params_b"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(sharded[r]["next_a"], sharded[r]["next_b"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(sharded[r]["lars_a"], sharded[r]["lars_b"], rtol=1e-10, atol=1e-10)
        assert sharded[r]["lr_after_sync"] == 2.0
    torch.testing.assert_close(sharded[0]["state"], sharded[1]["state"], rtol=0, atol=0)  # full state on every rank
    torch.testing.assert_close(sharded[0]["state"]["state"], sharded[0]["plain_state"]["state"],
                               rtol=1e-10, atol=1e-10)


def _resume_at_world_size_1(params: torch.Tensor, path: str) -> torch.Tensor:
    net = Net()
    vector_to_parameters(params.clone(), net.body.parameters())  # it aliases the vector's storage
    opt = ShardedOptimizer(net.body.parameters(), torch.optim.AdamW, average_gradients=True, lr=1.0)
    opt.load_state_dict(torch.load(path, weights_only=True))  # restores lr and weight decay too
    train(net, opt, 1, loss_fn=lambda n: global_loss(n, use_extra=False))
    return vec(net.body)


def test_sharded_checkpoint_resumes_at_another_world_size(sharded, tmp_path):
    path = str(tmp_path / "opt.pt")
    torch.save(sharded[1]["state"], path)  # any rank can save it
    expected = sharded[0]["next_b"]  # the unsharded W=2 run continued
    # W=1 without a process group (plain AdamW fallback) ...
    torch.testing.assert_close(_resume_at_world_size_1(sharded[0]["params_a"], path), expected,
                               rtol=1e-10, atol=1e-10)
    # ... and W=1 with a process group (ZeroRedundancyOptimizer with one shard).
    (resumed,) = run_in_workers(_resume_at_world_size_1, world_size=1, args=(sharded[0]["params_a"], path),
                                backend="local")
    torch.testing.assert_close(resumed, expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------- single process
def test_refusals():
    net = Net()
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        GradientAveragingOptimizer(object())
    with pytest.raises(TypeError, match="LBFGS.*DistributedDataParallel"):
        GradientAveragingOptimizer(torch.optim.LBFGS(net.parameters()))
    frozen = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        GradientAveragingOptimizer(torch.optim.SGD([frozen], lr=0.1))
    with pytest.raises(TypeError, match="already communicates"):
        LocalSGD(GradientAveragingOptimizer(torch.optim.SGD(net.parameters(), lr=0.1)), period=2)
    with pytest.raises(ValueError, match="period"):
        LocalSGD(torch.optim.SGD(net.parameters(), lr=0.1), period=0)
    with pytest.raises(TypeError, match="LBFGS"):
        ShardedOptimizer(net.parameters(), torch.optim.LBFGS)
    with pytest.raises(TypeError, match="optimizer class"):
        ShardedOptimizer(net.parameters(), "adamw", lr=0.1)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        ShardedOptimizer([frozen], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="sgd, lars, adam, adamw"):
        build_optimizer("rmsprop", net.parameters(), lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="eta"):
        LARS(net.parameters(), lr=0.1, eta=0.0)


def test_single_process_wrappers_and_lr_scheduler():
    ref, nets = Net(), [Net() for _ in range(3)]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    opts = [GradientAveragingOptimizer(torch.optim.AdamW(nets[0].parameters(), lr=0.05)),
            LocalSGD(torch.optim.AdamW(nets[1].parameters(), lr=0.05), period=2),
            ShardedOptimizer(nets[2].parameters(), torch.optim.AdamW, lr=0.05)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in [ref_opt, *opts]]
    for _ in range(3):
        train(ref, ref_opt, 1, loss_fn=global_loss)
        for net, opt in zip(nets, opts):
            train(net, opt, 1, loss_fn=global_loss)
        for s in scheds:
            s.step()
    for net, opt in zip(nets, opts):
        assert (opt.rank, opt.world_size) == (0, 1)
        torch.testing.assert_close(vec(net), vec(ref), rtol=0, atol=0)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 / 8
        torch.testing.assert_close(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    assert opts[2].sharding["params_per_rank"] == [list(range(10))]


def test_lars_step_matches_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)  # ||p|| = 0 at step 1: trust 1
    grads = [[torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (w, b, z)] for _ in range(2)]
    lr, m, wd, eta = 0.5, 0.9, 0.1, 0.01
    opt = LARS([w, b, z], lr=lr, momentum=m, weight_decay=wd, eta=eta)
    sgd_b = b.detach().clone().requires_grad_(True)
    sgd = torch.optim.SGD([sgd_b], lr=lr, momentum=m)  # ndim <= 1: plain SGD with momentum
    def hand(p, grad, mu):  # the LARS formula, written out
        u = grad + wd * p
        trust = eta * p.norm() / u.norm() if p.norm() > 0 and u.norm() > 0 else 1.0
        mu = m * mu + trust * u
        return p - lr * mu, mu

    pw, pz, mu_w, mu_z = w.detach().clone(), z.detach().clone(), 0.0, 0.0
    for gw, gb, gz in grads:
        w.grad, b.grad, z.grad, sgd_b.grad = gw.clone(), gb.clone(), gz.clone(), gb.clone()
        opt.step()
        sgd.step()
        pw, mu_w = hand(pw, gw, mu_w)
        pz, mu_z = hand(pz, gz, mu_z)
    torch.testing.assert_close(w.detach(), pw, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z.detach(), pz, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.detach(), sgd_b.detach(), rtol=1e-12, atol=1e-12)

    # state_dict round trip: a fresh LARS loaded from the state continues identically.
    w2, b2, z2 = (t.detach().clone().requires_grad_(True) for t in (w, b, z))
    opt2 = LARS([w2, b2, z2], lr=0.0)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, gr in zip((w, b, z), (w2, b2, z2), grads[0]):
        p.grad, q.grad = gr.clone(), gr.clone()
    opt.step()
    opt2.step()
    for p, q in zip((w, b, z), (w2, b2, z2)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_lars_without_exclusion_adapts_biases():
    b = torch.ones(3, dtype=torch.float64, requires_grad=True)
    b.grad = torch.full((3,), 2.0, dtype=torch.float64)
    LARS([b], lr=1.0, momentum=0.0, weight_decay=0.0, eta=0.5, exclude_bias_and_norm=False).step()
    torch.testing.assert_close(b.detach(), torch.full((3,), 0.5, dtype=torch.float64))  # 1 - eta*(sqrt3/(2*sqrt3))*2
