"""CPU SyncBN (GlobalBatchNorm) against nn.BatchNorm on the concatenated global batch, real gloo processes."""

import pytest
import torch
import torch.nn as nn
from helpers.sync_batchnorm import CASES, _model

from unison.distributed import collectives as C
from unison.distributed.sync_batchnorm import GlobalBatchNorm, convert_sync_batchnorm
from unison.distributed.testing import run_in_workers

X, W_OUT = CASES["2d"]


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


def test_convert_keeps_frozen_parameters_frozen():
    """A momentum encoder's batch norm (BYOL's target, DINO's teacher) and --freeze's stay out of the optimizer after
    the CPU conversion, as after torch's CUDA one (which keeps the Parameter objects): they had become trainable."""
    from unison.methods.byol import BYOL
    from unison.models import build_backbone

    encoder, dim = build_backbone("small_cnn", 16)
    method = BYOL(encoder, dim, BYOL.Params(), steps_total=2)
    method.backbone.features[1].weight.requires_grad_(False)   # as --freeze leaves it
    before = {n for n, p in method.named_parameters() if p.requires_grad}
    assert any(n.startswith("backbone.") for n in before) and len(before) < len(list(method.parameters()))
    after = {n for n, p in convert_sync_batchnorm(method, "cpu").named_parameters() if p.requires_grad}
    assert after == before


# -- with real processes --

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
