"""FastSiam as a method: its four views (the augmentation presets), its loss over them, its view checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.data.presets import PRESETS
from unison.errors import ConfigError
from unison.methods import FastSiam, FastSiamParams

SMALL = dict(proj_hidden_dim=8, proj_dim=8, pred_hidden_dim=2)


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def test_fastsiams_augmentation_makes_four_views_on_every_data():
    recipe = FastSiam.recipe
    assert recipe.augmentation == "fastsiam" and recipe.for_data("digits").augmentation == "digits_fastsiam"
    assert (recipe.for_data("digits").base_lr, recipe.for_data("/data/cifar10/train").base_lr) == (0.1, 0.03)
    for preset, like in (("fastsiam", "mocov2"), ("digits_fastsiam", "digits")):
        assert PRESETS[preset]["n_global"] == 4 and PRESETS[preset]["n_local"] == 0
        assert {k: v for k, v in PRESETS[preset].items() if k != "n_global"} == \
            {k: v for k, v in PRESETS[like].items() if k != "n_global"}


def test_fastsiam_predicts_each_view_from_the_mean_of_the_others():
    torch.manual_seed(0)
    model = FastSiam(_backbone(), 4, FastSiamParams(**SMALL))
    g = torch.Generator().manual_seed(1)
    views = [torch.randn(5, 3, 8, 8, generator=g) for _ in range(4)]
    loss = model(views)
    z = [model.projector(model.backbone(v)) for v in views]      # per view, as the forward: BN per view
    torch.testing.assert_close(loss, model.loss_fn([model.predictor(t) for t in z], z))
    loss.backward()
    assert model.backbone[0].weight.grad.abs().sum() > 0


def test_fastsiam_views_are_checked():
    FastSiam.check_views(FastSiamParams(), None, [32] * 4)
    FastSiam.check_views(FastSiamParams(), None, [32] * 2)   # two views: SimSiam
    with pytest.raises(ConfigError, match=r"FastSiam takes 2 or more views of one size; the augmentation makes 6 "
                                          r"\(16, 16, 8, 8, 8, 8 px\): give --augmentation fastsiam"):
        FastSiam.check_views(FastSiamParams(), None, [16, 16, 8, 8, 8, 8])
    with pytest.raises(ConfigError, match="makes 1"):
        FastSiam.check_views(FastSiamParams(), None, [16])
    with pytest.raises(ValueError, match="2 or more views of one shape"):
        FastSiam(_backbone(), 4, FastSiamParams(**SMALL))([torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)])
