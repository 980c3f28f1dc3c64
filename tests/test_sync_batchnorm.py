"""CPU SyncBN (GlobalBatchNorm) against nn.BatchNorm on the concatenated global batch, real gloo processes."""

import pytest
import torch
import torch.nn as nn

from unison.distributed import collectives as C
from unison.distributed.sync_batchnorm import GlobalBatchNorm, convert_sync_batchnorm
from unison.distributed.testing import run_in_workers

G = torch.Generator().manual_seed(3)
SPLIT = [4, 6]                                                            # 10 rows: 4 on rank 0, 6 on rank 1
# Per case: the global input (a shift and scale that plain batch norm must remove) and an asymmetric
# upstream gradient. "2d" is a conv feature map, "1d" a projection head's [N, C], "2d_channels_last" the
# memory format a channels-last run feeds in.
CASES = {
    "2d": (torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64) * 3 + 1.5,
           torch.randn(10, 4, 5, 5, generator=G, dtype=torch.float64)),
    "1d": (torch.randn(10, 4, generator=G, dtype=torch.float64) * 2 - 0.7,
           torch.randn(10, 4, generator=G, dtype=torch.float64)),
}
CASES["2d_channels_last"] = tuple(t.contiguous(memory_format=torch.channels_last) for t in CASES["2d"])
X, W_OUT = CASES["2d"]


def _model(dim: int = 4) -> nn.Module:
    torch.manual_seed(0)
    bn = (nn.BatchNorm2d(4, momentum=0.3) if dim == 4 else nn.BatchNorm1d(4, momentum=0.3)).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


def _worker(case: str):
    x_all, w_out = CASES[case]
    bn = convert_sync_batchnorm(_model(x_all.dim()), "cpu")
    assert isinstance(bn, GlobalBatchNorm)
    start = sum(SPLIT[: C.rank()])
    rows = slice(start, start + SPLIT[C.rank()])
    x = x_all[rows].clone().requires_grad_(True)
    outs = []
    for _ in range(2):  # two steps: running statistics accumulate
        y = bn(x)
        outs.append(y.detach())
    (y * w_out[rows]).sum().backward()
    return {"y": outs[-1], "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "rm": bn.running_mean, "rv": bn.running_var, "nbt": bn.num_batches_tracked}


@pytest.mark.parametrize("case", list(CASES))
def test_global_batchnorm_matches_batchnorm_on_global_batch_uneven_ranks(case):
    out = run_in_workers(_worker, world_size=2, args=(case,))
    x_all, w_out = CASES[case]
    ref = _model(x_all.dim())
    x = x_all.clone().requires_grad_(True)
    for _ in range(2):
        y = ref(x)
    (y * w_out).sum().backward()
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
