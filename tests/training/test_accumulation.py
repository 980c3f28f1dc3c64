"""Exact gradient accumulation (`unison.training.accumulate`), in one process (W=1, float64).

K=2 exact accumulation == one step on the whole batch for a BN-free backbone (a ViT), for coupled losses;
the old per-micro-batch objective (``--accumulation independent``) is not; the backbones are left as they were;
the combinations exact accumulation refuses are one line before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unison.cli.train_args import parse_train_args
from unison.config.distributed import DistributedConfig
from unison.distributed.env import init_distributed, shutdown_distributed
from unison.equivalence.steps import CheckSpec, compare, record_steps, reference
from unison.errors import ConfigError

_VIT = "vit_nano_p2"


def _record(spec_dict: dict) -> dict:
    """`unison check`'s record of the production step, in this process (world size 1)."""
    init_distributed(DistributedConfig(backend="local", world_size=1))
    try:
        return record_steps(spec_dict)
    finally:
        shutdown_distributed(None)   # one process: nothing to wait for


def _check(method: str, accumulation: str = "exact") -> tuple[float, str]:
    """(largest relative difference of loss, gradients, state; the reference) of W=1 x K=2 against its reference."""
    spec = CheckSpec(method=method, world_size=1, local_batch=4, steps=1, grad_sync_every=2, backbone=_VIT, image_size=8,
                     accumulation=accumulation)
    accumulated = _record(dataclasses.asdict(spec))
    single_spec, what = reference(spec, accumulated)
    single = _record(single_spec)
    report = compare(accumulated, single, spec)
    return max(report.max_rel_loss, report.max_rel_grad, report.max_rel_state), what


@pytest.mark.parametrize("method", ["simclr", "swav"])
def test_exact_accumulation_equals_one_step_on_the_whole_batch(method):
    """NT-Xent's negatives / SwAV's Sinkhorn codes over all K micro-batches, heads' batch norm over the step."""
    worst, what = _check(method)
    assert "ONE step" in what
    assert worst < 1e-9, (method, worst)


def test_independent_accumulation_is_not_one_batch():
    """The old objective, a loss per micro-batch (4 images' negatives each), differs from one step on all 8."""
    spec = CheckSpec(method="simclr", world_size=1, local_batch=4, steps=1, grad_sync_every=2, backbone=_VIT, image_size=8,
                     accumulation="independent")
    independent = _record(dataclasses.asdict(spec))
    single = _record(dict(dataclasses.asdict(spec), local_batch=8, grad_sync_every=1))
    assert compare(independent, single, spec).max_rel_grad > 1e-3


def test_the_step_leaves_the_backbones_as_they_were():
    """After an exact step no interception is left on the backbones: `forward` is the class's own again."""
    from unison.config import TrainConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.training.accumulate import backbones
    from unison.training.step import accumulated_forward_backward, build_run, steps

    cfg = TrainConfig(method="simclr", data="synthetic", batch_size=4, max_steps=1, precision="float64", threads=1,
                      distributed=DistributedConfig(backend="local", world_size=1, grad_sync_every=2))
    init_distributed(cfg.distributed)
    try:
        run = build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(8, 16, 0))
        assert run.exact
        loss = accumulated_forward_backward(run, next(steps(run)))
        assert torch.isfinite(loss)
        assert all("forward" not in b.__dict__ for b in backbones(run.method))
        assert all(p.grad is not None for p in run.trainable)
    finally:
        shutdown_distributed(None)   # one process: nothing to wait for


@pytest.mark.parametrize("argv, fragment", [
    (["--compile"], "does not combine with --compile"),
    (["--world-size", "2", "--grad-compression", "fp16"], "does not combine with --grad-compression fp16"),
    (["--world-size", "2", "--shard", "full"], "does not combine with --shard full"),
])
def test_exact_accumulation_refuses_what_it_cannot_combine_with(argv, fragment):
    """The pre-flight of unison train (and of unison check) refuses them, naming --accumulation independent."""
    with pytest.raises(ConfigError, match="--accumulation independent") as error:
        parse_train_args(["--method", "simclr", "--data", "digits", "--grad-sync-every", "2", *argv])
    assert fragment in str(error.value) and "\n" not in str(error.value)
    # plain accumulation (MAE: a mean over samples) and K=1 have nothing to refuse
    parse_train_args(["--method", "mae", "--data", "digits", "--grad-sync-every", "2", *argv])
    parse_train_args(["--method", "simclr", "--data", "digits", "--grad-sync-every", "2", *argv,
                      "--accumulation", "independent"])


def test_a_step_never_spans_two_epochs_of_per_sample_keys():
    """iBOT's masks are keyed by (seed, epoch, index): 3 batches per epoch cannot form steps of 2 micro-batches."""
    from unison.config import TrainConfig
    from unison.data.synthetic import synthetic_dataset
    from unison.training.step import build_run

    cfg = TrainConfig(method="ibot", data="synthetic", batch_size=4, max_steps=1, precision="float64", threads=1,
                      distributed=DistributedConfig(backend="local", world_size=1, grad_sync_every=2))
    init_distributed(cfg.distributed)
    try:
        with pytest.raises(ConfigError, match="would span two epochs.*--accumulation independent"):
            build_run(cfg, torch.device("cpu"), train_set=synthetic_dataset(12, 16, 0))
    finally:
        shutdown_distributed(None)   # one process: nothing to wait for


def test_dropout_replays_identically_in_the_second_pass():
    """Pass 2 restores each micro-batch's generator state: the gradient equals that of the same micro-batches
    run once with their graphs (same dropout masks), and the generator ends where pass 1 left it."""
    from torch import nn

    from unison.methods.simclr import SimCLR, SimCLRParams
    from unison.training.accumulate import ExactAccumulation, micro_rows

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.Dropout(0.5))
    method = SimCLR(backbone, 16, SimCLRParams(proj_hidden_dim=8, proj_dim=4)).double()
    views = [torch.randn(8, 3, 4, 4, dtype=torch.float64) for _ in range(2)]

    torch.manual_seed(1)
    with ExactAccumulation(method, micro_batches=2, rows=4) as cache:
        method(views).backward()
        cache.replay()
    exact = {n: p.grad.clone() for n, p in method.named_parameters()}
    after_exact = torch.rand(1)
    method.zero_grad()

    original = backbone.forward

    def with_graph(x: torch.Tensor) -> torch.Tensor:   # the same micro-batches, in the same order, with graphs
        out = x.new_zeros(x.shape[0], 16)
        for rows in micro_rows(x.shape[0], 2, 4, x.device):
            out = out.index_copy(0, rows, original(x[rows]))
        return out

    torch.manual_seed(1)
    backbone.forward = with_graph
    method(views).backward()
    assert torch.equal(torch.rand(1), after_exact)
    for n, p in method.named_parameters():
        torch.testing.assert_close(exact[n], p.grad, rtol=1e-12, atol=1e-14, msg=n)
