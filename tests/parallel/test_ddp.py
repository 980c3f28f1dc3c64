"""DDP wiring with real gloo processes: accumulation via no_sync, comm hooks (bytes counted), rank-local state."""

import gc

import torch
import torch.nn as nn

from unison.config.distributed import DistributedConfig
from unison.distributed import collectives as C
from unison.distributed.comm_meter import CommMeter
from unison.distributed.tagging import mark_rank_local_state
from unison.distributed.testing import run_in_workers
from unison.parallel.ddp import grad_sync_context, wrap_ddp

D = 32


G = torch.Generator().manual_seed(1)


DATA = torch.randn(2, 2, 4, D, generator=G, dtype=torch.float64)   # [rank, micro-batch, rows, features]


TARGET = torch.randn(D, D, generator=G, dtype=torch.float64)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()


def _loss(model, x):
    return ((model(x) - x @ TARGET) ** 2).mean()


def _accumulation_worker(k: int):
    cfg = DistributedConfig(world_size=2, rank=C.rank(), backend="gloo", grad_sync_every=k, sync_batchnorm=False)
    ddp = wrap_ddp(_net(), cfg, torch.device("cpu"), metered=True)
    bytes_per_micro = []
    grads_after_first = None
    for micro in range(k):
        with CommMeter() as meter:
            with grad_sync_context(ddp, micro, k):
                (_loss(ddp, DATA[C.rank(), micro]) / k).backward()
        bytes_per_micro.append(meter.bytes.get("all_reduce", 0))
        if micro == 0:
            grads_after_first = torch.cat([p.grad.flatten() for p in ddp.parameters()]).clone()
    grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    return {"grads": grads, "first": grads_after_first, "bytes": bytes_per_micro}


def test_grad_sync_every_equals_accumulated_global_batch():
    out = run_in_workers(_accumulation_worker, 2, args=(2,))
    ref = _net()
    _loss(ref, DATA.reshape(-1, D)).backward()
    expected = torch.cat([p.grad.flatten() for p in ref.parameters()])
    for o in out:
        torch.testing.assert_close(o["grads"], expected, rtol=1e-10, atol=1e-12)
        assert o["bytes"][0] == 0, "no gradient may be communicated inside no_sync"
        assert o["bytes"][1] == expected.numel() * 8
    assert not torch.allclose(out[0]["first"], out[1]["first"]), "micro-batch 1 must stay local"


def _hook_worker(compression: str, steps: int):
    cfg = DistributedConfig(world_size=2, rank=C.rank(), backend="gloo", grad_compression=compression,
                            powersgd_rank=2, powersgd_start_iter=2, sync_batchnorm=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    ddp = wrap_ddp(model, cfg, torch.device("cpu"), metered=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + C.rank())
    per_step, losses, grads = [], [], []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        with CommMeter() as meter:
            loss = (ddp(x) - x.flip(1)).pow(2).mean()
            loss.backward()
        per_step.append(meter.total_bytes)
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).clone())
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return {"bytes": per_step, "grads": grads, "losses": losses,
            "numel": sum(p.numel() for p in model.parameters())}


def _all_hooks_worker(steps: int):
    out = {}
    for c in ("none", "fp16", "powersgd"):
        out[c] = _hook_worker(c, steps)
        # The finished DDP is cyclic garbage. Collected later by a collection that starts inside a comm hook's
        # callback, which runs on a gloo thread, its teardown would join that thread from itself and abort the
        # process ("Resource deadlock avoided"): free it here, on the main thread.
        gc.collect()
    return out


def test_fp16_and_powersgd_hooks_send_fewer_bytes():
    steps = 6
    by_rank = run_in_workers(_all_hooks_worker, 2, args=(steps,))
    results = {c: [by_rank[0][c], by_rank[1][c]] for c in ("none", "fp16", "powersgd")}
    numel = results["none"][0]["numel"]
    assert results["none"][0]["bytes"] == [numel * 4] * steps          # fp32 gradient, counted
    assert results["fp16"][0]["bytes"] == [numel * 2] * steps          # exactly half
    psgd = results["powersgd"][0]["bytes"]
    assert psgd[0] == numel * 4                                        # plain all-reduce before start_iter
    # rank-2 factors of two 64x64 weights: P and Q are 64x2 each -> (4 * 128 + 128 biases) floats
    assert psgd[-1] == (2 * (64 * 2 + 64 * 2) + 128) * 4
    assert psgd[-1] < numel * 4 / 5
    # every rank applies the same (decompressed) gradient
    for c in ("fp16", "powersgd"):
        for a, b in zip(results[c][0]["grads"], results[c][1]["grads"]):
            torch.testing.assert_close(a, b)
    # fp16 compression changes the gradient only at fp16 precision
    torch.testing.assert_close(results["fp16"][0]["grads"][0], results["none"][0]["grads"][0], rtol=2e-3, atol=1e-5)


class _WithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("queue", torch.zeros(4))
        self.register_buffer("shared_stat", torch.zeros(4))
        mark_rank_local_state(self, ["queue"])

    def forward(self, x):
        return self.lin(x).sum()


def _state_worker():
    m = _WithState()
    m.queue.fill_(float(C.rank() + 1))
    m.shared_stat.fill_(float(C.rank() + 1))
    cfg = DistributedConfig(world_size=2, rank=C.rank(), backend="gloo", sync_batchnorm=False)
    ddp = wrap_ddp(m, cfg, torch.device("cpu"))   # broadcast_buffers=True without SyncBN
    for _ in range(3):
        ddp(torch.ones(2, 3)).backward()
    return {"queue": m.queue.clone(), "shared_stat": m.shared_stat.clone()}


def test_rank_local_buffers_are_never_broadcast():
    out = run_in_workers(_state_worker, 2)
    assert torch.all(out[0]["queue"] == 1) and torch.all(out[1]["queue"] == 2)
    # the unmarked buffer *is* overwritten by DDP with rank 0's copy: the mechanism the mark prevents
    assert torch.all(out[1]["shared_stat"] == 1)
