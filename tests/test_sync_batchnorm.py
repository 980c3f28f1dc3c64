"""CPU SyncBN (GlobalBatchNorm) against nn.BatchNorm on the concatenated global batch, real gloo processes."""

import torch
import torch.nn as nn

from unison.distributed import collectives as C
from unison.distributed.sync_batchnorm import GlobalBatchNorm, convert_sync_batchnorm
from unison.distributed.testing import run_in_workers

G = torch.Generator().manual_seed(3)
X = torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64) * 3 + 1.5   # 10 rows: 4 on rank 0, 6 on rank 1
W_OUT = torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64)        # asymmetric upstream gradient
SPLIT = [4, 6]


def _model() -> nn.Module:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _worker():
    bn = convert_sync_batchnorm(_model(), "cpu")
    assert isinstance(bn, GlobalBatchNorm)
    start = sum(SPLIT[: C.rank()])
    rows = slice(start, start + SPLIT[C.rank()])
    x = X[rows].clone().requires_grad_(True)
    outs = []
    for _ in range(2):  # two steps: running statistics accumulate
        y = bn(x)
        outs.append(y.detach())
    (y * W_OUT[rows]).sum().backward()
    return {"y": outs[-1], "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "rm": bn.running_mean, "rv": bn.running_var, "nbt": bn.num_batches_tracked}


def test_global_batchnorm_matches_batchnorm_on_global_batch_uneven_ranks():
    out = run_in_workers(_worker, world_size=2)
    ref = _model()
    x = X.clone().requires_grad_(True)
    for _ in range(2):
        y = ref(x)
    (y * W_OUT).sum().backward()
    torch.testing.assert_close(torch.cat([o["y"] for o in out]), y.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([o["dx"] for o in out]), x.grad, rtol=1e-10, atol=1e-10)
    # Parameter gradients are per-rank partial sums; their sum is the global gradient.
    torch.testing.assert_close(out[0]["dw"] + out[1]["dw"], ref.weight.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[0]["db"] + out[1]["db"], ref.bias.grad, rtol=1e-10, atol=1e-10)
    for o in out:
        torch.testing.assert_close(o["rm"], ref.running_mean, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(o["rv"], ref.running_var, rtol=1e-10, atol=1e-10)
        assert int(o["nbt"]) == int(ref.num_batches_tracked)


def test_local_batchnorm_would_differ():
    """Guard against a vacuous test: per-rank statistics really differ from the global ones."""
    ref = _model()
    y_global = ref(X)
    y_local = torch.cat([_model()(X[:4]), _model()(X[4:])])
    assert (y_global - y_local).abs().max() > 1e-2


def test_convert_keeps_weights_and_eval_mode():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    with torch.no_grad():
        m[1].weight.fill_(2.0)
        m[1].running_mean.fill_(0.5)
    m.eval()
    c = convert_sync_batchnorm(m, "cpu")
    assert isinstance(c[1], GlobalBatchNorm) and isinstance(c[2][0], GlobalBatchNorm)
    assert not c[1].training
    assert torch.all(c[1].weight == 2.0) and torch.all(c[1].running_mean == 0.5)
