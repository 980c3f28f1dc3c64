"""DCL and DCLW as methods: their loss, parameters, recipe and views (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.errors import ConfigError
from unison.losses import DCLLoss, DCLWLoss
from unison.methods import DCL, DCLW, METHODS, DCLParams, DCLWParams, SimCLR


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def test_dcl_and_dclw_are_simclr_with_the_decoupled_loss():
    assert METHODS["dcl"] is DCL and METHODS["dclw"] is DCLW
    dcl, dclw = DCL(_backbone(), 4, DCLParams()), DCLW(_backbone(), 4, DCLWParams())
    assert type(dcl.loss_fn) is DCLLoss and dcl.loss_fn.sigma is None
    assert type(dclw.loss_fn) is DCLWLoss and dclw.loss_fn.sigma == 0.5 and dclw.loss_fn.temperature == 0.1
    assert DCL.recipe == DCLW.recipe == SimCLR.recipe   # Lightly's CIFAR-10 benchmark trains them as its SimCLR


def test_dcl_trains_both_views_in_one_pass():
    torch.manual_seed(0)
    model = DCLW(_backbone(), 4, DCLWParams(proj_hidden_dim=8, proj_dim=4))
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(6, 3, 8, 8, generator=g) for _ in range(2)]
    loss = model(views)
    z_a, z_b = model.projector(model.backbone(torch.cat(views))).chunk(2)
    torch.testing.assert_close(loss, model.loss_fn(z_a, z_b))
    loss.backward()
    assert model.backbone[0].weight.grad.abs().sum() > 0


def test_dclw_sigma_is_checked_and_views_must_be_two():
    with pytest.raises(ConfigError, match=r"DCLW parameter sigma=0 must be a finite number >= 0.0001"):
        DCLWParams(sigma=0)
    with pytest.raises(ConfigError, match="DCL parameter temperature"):
        DCLParams(temperature=-1.0)
    with pytest.raises(ConfigError, match="DCLW takes exactly 2 views of one size"):
        DCLW.check_views(DCLWParams(), None, [16, 16, 16, 16])
