"""Full sharding (``--shard full``, FSDP2): exact like one process, optimizers on DTensors, grad accumulation.

Real gloo processes with different data on each rank, float64. Checkpoints of sharded runs:
tests/*/training/test_dcp_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.every_method import check_every_method
from torch import nn

from unison.distributed import collectives as C
from unison.distributed.testing import run_in_workers
from unison.equivalence import run_equivalence
from unison.methods import METHODS
from unison.optim import OPTIMIZER_NAMES, build_optimizer

pytestmark = pytest.mark.distributed

# ------------------------------------------------------------------ unison check --shard full
@pytest.fixture(scope="module")
def fully_sharded_reports():
    """Every method's check at W=2 under --shard full (as `unison check --method all`; the ViT methods on a smaller
    ViT: tests/helpers/every_method.py)."""
    return check_every_method(2, steps=2, shard="full")


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_check_passes_fully_sharded(method, fully_sharded_reports):
    """W=2 fully sharded (parameters, gradients, optimizer state) == 1 process on the global batch."""
    report = fully_sharded_reports[method]
    assert report.spec.method == method and report.passed, report.summary()
    assert "shard=full" in report.summary()


@pytest.mark.slow
def test_check_fails_fully_sharded_without_an_exactness_switch():
    report = run_equivalence("byol", world_size=2, steps=2, shard="full", sync_batchnorm=False)
    assert not report.passed and report.max_rel_grad > 1e-3, report.summary()
    report = run_equivalence("simclr", world_size=2, steps=2, shard="full", gather_distributed=False)
    assert not report.passed and report.max_rel_loss > 1e-3, report.summary()


# ------------------------------------------------------------------ optimizers on sharded parameters
DIM, ROWS, STEPS = 6, 8, 3


HYPER = {"sgd": {"lr": 0.1, "weight_decay": 0.1}, "adam": {"lr": 0.05, "weight_decay": 0.1},
         "adamw": {"lr": 0.05, "weight_decay": 0.1}, "lars": {"lr": 2.0, "weight_decay": 0.1}}


_g = torch.Generator().manual_seed(5)


X = torch.randn(ROWS, DIM, generator=_g, dtype=torch.float64)


Y = torch.randn(ROWS, 3, generator=_g, dtype=torch.float64)


def _net() -> nn.Sequential:
    g = torch.Generator().manual_seed(7)
    # 7 output rows: uneven shards (4 + 3) at W=2; a 1-D bias for LARS's exclusion
    net = nn.Sequential(nn.Linear(DIM, 7, dtype=torch.float64), nn.Tanh(), nn.Linear(7, 3, dtype=torch.float64))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return net


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net(x) - y) ** 2).sum(1).mean()


def _train_sharded(name: str) -> dict[str, torch.Tensor]:
    from unison.distributed.dtensor import full_tensor
    from unison.parallel.fsdp import fully_shard

    net = _net()
    for layer in (net[0], net[2]):
        fully_shard(layer)
    fully_shard(net)
    opt = build_optimizer(name, net.parameters(), **HYPER[name])
    rows = C.local_slice(ROWS)
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(net, X[rows], Y[rows]).backward()
        opt.step()
    return {k: full_tensor(v).detach().clone() for k, v in net.state_dict().items()}


def _sharded_worker() -> dict[str, dict[str, torch.Tensor]]:
    return {name: _train_sharded(name) for name in OPTIMIZER_NAMES}


@pytest.fixture(scope="module")
def sharded_runs():
    return run_in_workers(_sharded_worker, world_size=2)


def _global_batch(name: str) -> dict[str, torch.Tensor]:
    net = _net()
    opt = build_optimizer(name, net.parameters(), **HYPER[name])
    for _ in range(STEPS):
        opt.zero_grad()
        _loss(net, X, Y).backward()
        opt.step()
    return {k: v.detach() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_steps_sharded_parameters_exactly(sharded_runs, name):
    expected = _global_batch(name)
    for rank in (0, 1):
        got = sharded_runs[rank][name]
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-12, msg=f"{name} {k} rank {rank}")
    assert (expected["0.weight"] - _net()[0].weight).abs().max() > 1e-3   # the optimizer moved the weights


def _lars_trust_of_slices(p: torch.Tensor, u: torch.Tensor, eta: float = 0.001) -> torch.Tensor:
    """The classic bug: each shard scaled with ||p_slice|| / ||u_slice|| (torch.chunk slices, as FSDP's)."""
    parts = [eta * a.norm() / b.norm() * b for a, b in zip(p.chunk(2), u.chunk(2))]
    return torch.cat(parts)


def test_lars_shard_norms_would_be_caught():
    """The per-shard-norm update differs from the full-norm one far beyond the 1e-12 of the exactness test."""
    net = _net()
    _loss(net, X, Y).backward()
    p, u = net[0].weight.detach(), net[0].weight.grad + 0.1 * net[0].weight.detach()
    full = 0.001 * p.norm() / u.norm() * u
    assert (full - _lars_trust_of_slices(p, u)).abs().max() / full.abs().max() > 1e-2  # the bug would show


# ------------------------------------------------------------------ gradient accumulation
@pytest.mark.slow
def test_gradient_accumulation_under_full_sharding_matches_ddp(tmp_path):
    """--grad-sync-every 2 --accumulation independent: FSDP's set_requires_gradient_sync(False) == DDP's no_sync."""
    from unison.cli import main
    from unison.equivalence import assert_states_close
    from unison.training.checkpoint import load_checkpoint

    common = ["train", "--method", "byol", "--batch-size", "32", "--subset", "256", "--val-subset", "32",
              "--knn-k", "5", "--no-progress", "--precision", "float64", "--max-steps", "2", "--grad-sync-every",
              "2", "--accumulation", "independent", "--world-size", "2"]   # exact accumulation refuses FSDP
    assert main([*common, "--shard", "full", "--out", str(tmp_path / "full")]) == 0
    assert main([*common, "--shard", "none", "--out", str(tmp_path / "ddp")]) == 0
    full, ddp = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "ddp")
    assert full["step"] == ddp["step"] == 2
    assert_states_close(full["model"], ddp["model"], tol=1e-9)


# ------------------------------------------------------------------ blocks and activation checkpointing
def test_backbone_blocks_found_generically():
    from unison.models import build_backbone
    from unison.parallel.fsdp import backbone_blocks

    pytest.importorskip("timm")
    cnn, _ = build_backbone("small_cnn")
    assert len(backbone_blocks(cnn)) == 8   # 4 conv + 4 BN layers of `features`
    vit, _ = build_backbone("timm:vit_tiny_patch16_224")
    blocks = backbone_blocks(vit)
    assert len(blocks) == 12 and all(type(b).__name__ == "Block" for b in blocks)


def _grads_with_and_without_checkpointing(backbone: str, image_size: int) -> list[dict[str, torch.Tensor]]:
    from unison.config import TrainConfig
    from unison.config.distributed import DistributedConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import batches, build_run, forward_backward

    out = []
    for ac in (False, True):
        cfg = TrainConfig(method="simclr", data="synthetic", backbone=backbone, batch_size=4, max_steps=1,
                          epochs=1, precision="float64", threads=1, progress=False,
                          distributed=DistributedConfig(backend="local", world_size=1, shard="full",
                                                        activation_checkpointing=ac))
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(4, image_size, 0))
        forward_backward(run, next(batches(run)))
        out.append({n: p.grad.full_tensor() for n, p in run.method.named_parameters() if p.grad is not None})
    return out


def test_activation_checkpointing_gives_the_same_gradients():
    """ViT blocks recomputed in the backward (FSDP at W=1): the same gradients, bit for bit."""
    pytest.importorskip("timm")
    plain, checkpointed = run_in_workers(_grads_with_and_without_checkpointing, 1,
                                         args=("timm:vit_tiny_patch16_224", 224), backend="local")[0]
    assert plain.keys() == checkpointed.keys() and len(plain) > 100
    for k in plain:
        torch.testing.assert_close(checkpointed[k], plain[k], rtol=0, atol=0, msg=k)
