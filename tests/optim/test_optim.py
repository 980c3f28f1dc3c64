"""ZeRO-1 (`ShardedOptimizer`) and LARS: real gloo processes, different data on each rank, float64.

One 2-process launch (module fixture `workers`) runs every distributed scenario (the model in
DDP, as in the training step); the references (one process on the global batch) and the
single-process tests run in the test process. LARS on FSDP-sharded parameters: tests/parallel/test_fsdp.py."""

import copy

import pytest
import torch
from helpers.optim import DIM, Net, X, Y, global_loss, train, vec
from torch.nn.utils import vector_to_parameters

from unison.distributed import collectives as C
from unison.distributed.testing import run_in_workers
from unison.optim import LARS, build_optimizer
from unison.parallel.zero import ShardedOptimizer


# ---------------------------------------------------------------------- single process
def test_refusals():
    net = Net()
    frozen = torch.zeros(3, dtype=torch.float64)
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


def test_single_process_sharded_optimizer_and_lr_scheduler():
    ref, net = Net(), Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    opt = ShardedOptimizer(net.parameters(), torch.optim.AdamW, lr=0.05)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (ref_opt, opt)]
    for _ in range(3):
        train(ref, ref_opt, 1, loss_fn=global_loss)
        train(net, opt, 1, loss_fn=global_loss)
        for s in scheds:
            s.step()
    assert (opt.rank, opt.world_size) == (0, 1)
    torch.testing.assert_close(vec(net), vec(ref), rtol=0, atol=0)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.05 / 8
    torch.testing.assert_close(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    assert opt.sharding["params_per_rank"] == [list(range(10))]


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


# -- with real processes --

STEPS = 3


ADAMW = dict(lr=0.05, weight_decay=0.01)


# ----------------------------------------------------- distributed: ZeRO-1 under DDP
def _ddp_train(net: Net, opt, steps: int) -> None:
    """`steps` steps of the body on this rank's rows, gradients averaged by DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(net.body)
    rows = C.local_slice(X.shape[0])
    for _ in range(steps):
        opt.zero_grad()
        ((ddp(X[rows]) - Y[rows]) ** 2).sum(1).mean().backward()
        opt.step()


def _sharded_worker():
    out = {}
    a = Net()  # only `body` (four equally sized layers) is optimised
    sharded = ShardedOptimizer(a.body.parameters(), torch.optim.AdamW, **ADAMW)
    _ddp_train(a, sharded, STEPS)
    out.update(sharded_bytes=sharded.local_state_bytes(), sharding=sharded.sharding, params=vec(a.body),
               state=copy.deepcopy(sharded.state_dict()))
    _ddp_train(a, sharded, 1)
    out["next"] = vec(a.body)

    c = Net()  # LARS through ZeRO
    _ddp_train(c, ShardedOptimizer(c.body.parameters(), LARS, lr=2.0, weight_decay=0.1), STEPS)
    out["lars"] = vec(c.body)
    return out


@pytest.fixture(scope="module")
def sharded():
    return run_in_workers(_sharded_worker, world_size=2)


def _global_batch_reference(opt_class, steps: int, **hyper) -> tuple[torch.Tensor, dict]:
    net = Net()
    opt = opt_class(net.body.parameters(), **hyper)
    train(net, opt, steps, loss_fn=lambda n: global_loss(n, use_extra=False))
    return vec(net.body), opt.state_dict()


@pytest.mark.distributed
def test_sharded_state_is_split(sharded):
    full = 2 * 4 * (DIM * DIM + DIM) * 8 + 8 * 4  # exp_avg + exp_avg_sq (float64) + 8 float32 steps
    for r in (0, 1):
        assert abs(sharded[r]["sharded_bytes"] - full / 2) <= 0.35 * full / 2
    assert sharded[0]["sharded_bytes"] + sharded[1]["sharded_bytes"] == full
    s = sharded[0]["sharding"]
    assert s == sharded[1]["sharding"] and s["world_size"] == 2
    assert sorted(s["params_per_rank"][0] + s["params_per_rank"][1]) == list(range(8))
    assert s["numel_per_rank"] == [84, 84]


@pytest.mark.distributed
def test_sharded_matches_one_process_on_the_global_batch(sharded):
    params, state = _global_batch_reference(torch.optim.AdamW, STEPS, **ADAMW)
    after, _ = _global_batch_reference(torch.optim.AdamW, STEPS + 1, **ADAMW)
    lars, _ = _global_batch_reference(LARS, STEPS, lr=2.0, weight_decay=0.1)
    for r in (0, 1):
        torch.testing.assert_close(sharded[r]["params"], params, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(sharded[r]["next"], after, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(sharded[r]["lars"], lars, rtol=1e-10, atol=1e-10)
    assert (params - vec(Net().body)).abs().max() > 1e-3  # the test is not vacuous
    # The consolidated state is on rank 0 only, in the format of the unsharded optimizer.
    assert sharded[1]["state"] == {}
    torch.testing.assert_close(sharded[0]["state"]["state"], state["state"], rtol=1e-10, atol=1e-10)


def _resume_at_world_size_1(params: torch.Tensor, path: str) -> torch.Tensor:
    net = Net()
    vector_to_parameters(params.clone(), net.body.parameters())  # it aliases the vector's storage
    opt = ShardedOptimizer(net.body.parameters(), torch.optim.AdamW, lr=1.0)
    opt.load_state_dict(torch.load(path, weights_only=True))  # restores lr and weight decay too
    train(net, opt, 1, loss_fn=lambda n: global_loss(n, use_extra=False))
    return vec(net.body)


@pytest.mark.distributed
def test_sharded_checkpoint_resumes_at_another_world_size(sharded, tmp_path):
    path = str(tmp_path / "opt.pt")
    torch.save(sharded[0]["state"], path)
    expected = sharded[0]["next"]  # the W=2 run continued
    # W=1 without a process group (plain AdamW fallback) ...
    torch.testing.assert_close(_resume_at_world_size_1(sharded[0]["params"], path), expected,
                               rtol=1e-10, atol=1e-10)
    # ... and W=1 with a process group (ZeroRedundancyOptimizer with one shard).
    (resumed,) = run_in_workers(_resume_at_world_size_1, world_size=1, args=(sharded[0]["params"], path),
                                backend="local")
    torch.testing.assert_close(resumed, expected, rtol=1e-10, atol=1e-10)
