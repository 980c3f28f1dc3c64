"""TiCo as a method: its momentum target, its covariance state, its parameters and views (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.distributed.tagging import rank_local_state_names
from unison.errors import ConfigError
from unison.methods import TiCo, TiCoParams

SMALL = dict(proj_hidden_dim=8, proj_dim=4)


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _views(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 3, 8, 8, generator=g) for _ in range(2)]


def test_tico_trains_the_online_view_against_its_momentum_target():
    torch.manual_seed(0)
    model = TiCo(_backbone(), 4, TiCoParams(**SMALL), steps_total=10)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    covariances = []
    for step in range(3):
        loss = model(_views(step))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for p in model.target.parameters())
        opt.step()
        online = [p.detach().clone() for p in model.projector.parameters()]
        target = [p.detach().clone() for p in model.target.projector.parameters()]
        model.on_after_step(step)
        m = model.momentum(step)
        for o, t, after in zip(online, target, model.target.projector.parameters()):
            torch.testing.assert_close(after, m * t + (1 - m) * o)
        covariances.append(model.loss_fn.covariance.clone())
    assert model.momentum(0) == pytest.approx(0.99) and model.momentum(10) == pytest.approx(1.0)
    assert not torch.equal(covariances[0], covariances[1])   # one update per training forward
    assert int(model.step_count) == 3


def test_tico_state_is_rank_local_and_checkpointed():
    torch.manual_seed(0)
    model = TiCo(_backbone(), 4, TiCoParams(**SMALL))
    model(_views(0))
    names = set(rank_local_state_names(model))
    assert {"loss_fn.covariance", "step_count"} <= names and any(n.startswith("target.") for n in names)
    fresh = TiCo(_backbone(), 4, TiCoParams(**SMALL))
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.loss_fn.covariance, model.loss_fn.covariance)
    assert model.loss_fn.covariance.abs().sum() > 0


def test_tico_parameters_and_views_are_checked():
    with pytest.raises(ConfigError, match=r"TiCo parameter beta=1.5 must be a number in \[0, 1\]"):
        TiCoParams(beta=1.5)
    with pytest.raises(ConfigError, match="TiCo parameter rho"):
        TiCoParams(rho=-1.0)
    with pytest.raises(ConfigError, match="TiCo takes exactly 2 views"):
        TiCo.check_views(TiCoParams(), None, [16])
