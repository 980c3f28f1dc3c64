"""Collectives with real gloo processes and different data on each rank."""

import torch

from unison.distributed import collectives as C
from unison.distributed.testing import run_in_workers


def test_single_process_collectives_are_identity():
    x = torch.randn(3, 2, requires_grad=True)
    assert C.all_gather_with_grad(x) is x
    assert C.all_reduce_with_grad(x) is x
    torch.testing.assert_close(C.gather_no_grad(x), x.detach())
    assert C.world_size() == 1 and C.rank() == 0


# -- with real processes --

GLOBAL = torch.arange(24, dtype=torch.float64).reshape(6, 4).sin()  # 6 rows, 3 per rank at W=2


WEIGHTS = torch.linspace(0.5, 2.0, 6, dtype=torch.float64)  # asymmetric per-row weights


def _asymmetric_loss(x_all: torch.Tensor, r: int) -> torch.Tensor:
    # Each rank's loss depends on *all* rows, differently per rank, so dropping other ranks'
    # contributions (the classic GatherLayer bug) changes the gradient.
    return ((x_all ** 2).sum(1) * WEIGHTS * (r + 1)).sum() + x_all[0].sum() * (3 - r)


def _gather_grad_worker():
    rows = C.local_slice(GLOBAL.shape[0])
    x = GLOBAL[rows].clone().requires_grad_(True)
    loss = _asymmetric_loss(C.all_gather_with_grad(x), C.rank())
    loss.backward()
    return x.grad


def test_all_gather_backward_sums_every_ranks_loss():
    grads = run_in_workers(_gather_grad_worker, world_size=2)
    x = GLOBAL.clone().requires_grad_(True)
    (_asymmetric_loss(x, 0) + _asymmetric_loss(x, 1)).backward()
    torch.testing.assert_close(torch.cat(grads), x.grad, rtol=1e-12, atol=1e-12)


def _uneven_gather_worker():
    n = 2 if C.rank() == 0 else 4
    start = 0 if C.rank() == 0 else 2
    x = GLOBAL[start:start + n].clone().requires_grad_(True)
    y = C.all_gather_with_grad(x, uneven=True)
    (y.pow(3).sum() * (C.rank() + 1)).backward()
    return {"y": y.detach(), "grad": x.grad}


def test_uneven_all_gather():
    out = run_in_workers(_uneven_gather_worker, world_size=2)
    torch.testing.assert_close(out[0]["y"], GLOBAL)
    torch.testing.assert_close(out[1]["y"], GLOBAL)
    expected = 3 * GLOBAL.pow(2) * (1 + 2)
    torch.testing.assert_close(torch.cat([out[0]["grad"], out[1]["grad"]]), expected)


def _all_reduce_worker():
    rows = C.local_slice(GLOBAL.shape[0])
    x = GLOBAL[rows].clone().requires_grad_(True)
    s = C.all_reduce_with_grad(x.T @ x)          # global Gram matrix
    loss = (s * s).sum() * (C.rank() + 1)          # rank-dependent loss of the global value
    loss.backward()
    return {"s": s.detach(), "grad": x.grad, "no_grad_sum": C.all_reduce_no_grad(x.detach(), average=True),
            "gathered": C.gather_no_grad(x), "max": C.all_reduce_max_no_grad(x)}


def test_all_reduce_backward_and_no_grad_helpers():
    out = run_in_workers(_all_reduce_worker, world_size=2)
    x = GLOBAL.clone().requires_grad_(True)
    s = x.T @ x
    ((s * s).sum() * 1 + (s * s).sum() * 2).backward()
    torch.testing.assert_close(out[0]["s"], s.detach())
    torch.testing.assert_close(torch.cat([out[0]["grad"], out[1]["grad"]]), x.grad)
    torch.testing.assert_close(out[0]["no_grad_sum"], (GLOBAL[:3] + GLOBAL[3:]) / 2)
    torch.testing.assert_close(out[1]["gathered"], GLOBAL)
    for r in (0, 1):
        assert torch.equal(out[r]["max"], torch.maximum(GLOBAL[:3], GLOBAL[3:])) and not out[r]["max"].requires_grad
