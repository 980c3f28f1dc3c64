"""CPU SyncBN (GlobalBatchNorm) against nn.BatchNorm on the concatenated global batch, real gloo processes."""

import pytest
import torch
from helpers.sync_batchnorm import CASES, _model

from unison.distributed import collectives as C
from unison.distributed.sync_batchnorm import GlobalBatchNorm, convert_sync_batchnorm
from unison.distributed.testing import run_in_workers

SPLIT = [4, 6]                                                            # 10 rows: 4 on rank 0, 6 on rank 1


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
