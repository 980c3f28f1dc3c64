"""MMCR as a method: its number of views is its parameter (the augmentation makes that many), one forward over
all of them, and a wrong number of views is one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.data.augment import ViewAugmenter
from unison.methods import MMCR, MMCRParams
from unison.training.resolve import resolve_recipe
from unison.training.step import data_spec


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


@pytest.mark.parametrize("given, views", [({}, 8), ({"n_views": 5}, 5)])
def test_the_augmentation_makes_the_views_the_parameter_asks_for(given, views):
    cfg = TrainConfig(method="mmcr", data="/data/images", method_params=given)
    assert resolve_recipe(cfg).global_views == views
    aug = ViewAugmenter(resolve_recipe(cfg).augmentation, 16, (0.5,) * 3, (0.25,) * 3,
                        **data_spec(cfg, resolve_recipe(cfg).at_size(cfg, 16)).augment_overrides())
    assert aug.view_sizes == [16] * views
    assert resolve_recipe(TrainConfig(method="simclr", data="/data/images")).global_views is None   # the preset's


def test_a_forward_over_the_views_trains_and_a_wrong_number_is_one_line():
    torch.manual_seed(0)
    model = MMCR(_backbone(), 4, MMCRParams(n_views=3, proj_hidden_dim=8, proj_dim=4))
    views = [torch.randn(6, 3, 8, 8) for _ in range(3)]
    loss = model(views)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() < 0                       # minus a nuclear norm
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="n_views=3 views per image, got 2"):
        model(views[:2])


def test_an_augmentation_with_local_crops_is_refused_before_any_worker_starts():
    from unison.errors import ConfigError

    MMCR.check_views(MMCRParams(n_views=3), None, [16, 16, 16])
    with pytest.raises(ConfigError, match="MMCR takes exactly 3 views of one size; the augmentation makes 5"):
        MMCR.check_views(MMCRParams(n_views=3), None, [16, 16, 16, 8, 8])
