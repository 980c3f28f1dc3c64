"""ZeRO-1 (`ShardedOptimizer`) and LARS: real gloo processes, different data on each rank, float64.

One 2-process launch (module fixture `workers`) runs every distributed scenario (the model in
DDP, as in the training step); the references (one process on the global batch) and the
single-process tests run in the test process. LARS on FSDP-sharded parameters: tests/distributed/parallel/test_fsdp.py.
"""

import copy

import pytest
import torch
from helpers.optim import DIM, Net, X, Y, global_loss, train, vec
from torch.nn.utils import vector_to_parameters

from unison.distributed import collectives as C
from unison.distributed.testing import run_in_workers
from unison.optim import LARS
from unison.parallel.zero import ShardedOptimizer

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
