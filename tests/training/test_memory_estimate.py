"""The one memory estimate (`unison.training.memory.model_state`) against what a real step holds: every optimizer's
state after a step, gradients of trainable parameters only, and the shares under ZeRO-1 and FSDP2."""

import dataclasses

import pytest
import torch
from torch import nn

from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.optim import OPTIMIZER_NAMES, build_optimizer
from unison.training.memory import model_state


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).to(dtype)
    model[2].requires_grad_(False)   # as a momentum teacher: no gradient, no optimizer state
    return model


def _held(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    return grads, state


@pytest.mark.parametrize("precision", ["float32", "float64"])
@pytest.mark.parametrize("name, momentum", [*((n, 0.9) for n in OPTIMIZER_NAMES), ("sgd", 0.0), ("lars", 0.0)])
def test_the_estimate_is_what_a_step_holds(name, momentum, precision):
    dtype = getattr(torch, precision)
    model = _model(dtype)
    optimizer = build_optimizer(name, [p for p in model.parameters() if p.requires_grad], lr=0.1,
                                weight_decay=0.0, momentum=momentum)
    model(torch.randn(6, 8, dtype=dtype)).square().mean().backward()
    optimizer.step()
    grads, state = _held(model, optimizer)
    est = model_state(model, TrainConfig(optimizer=name, momentum=momentum, precision=precision), name)
    assert (est.grads, est.optimizer) == (grads, state)
    assert est.params == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.buffers == sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.built == est.params + est.buffers and est.largest == "0.weight"


def test_sharding_divides_what_each_rank_holds():
    model = _model(torch.float32)
    whole = model_state(model, TrainConfig(optimizer="adamw"), "adamw")

    def at(shard: str):
        cfg = TrainConfig(optimizer="adamw", distributed=DistributedConfig(world_size=4, shard=shard))
        return model_state(model, cfg, "adamw")

    zero1, full = at("optimizer"), at("full")
    assert dataclasses.replace(zero1, optimizer=whole.optimizer) == whole and zero1.optimizer == whole.optimizer // 4
    assert (full.params, full.grads, full.optimizer) == (whole.params // 4, whole.grads // 4, whole.optimizer // 4)
    assert full.buffers == whole.buffers and full.built == whole.built   # each worker builds the whole model
