"""EMP-SSL as a method: its patches are the augmentation's views (their number the parameter ``n_patches``), each a
square of a quarter of the image's area resized to the image size, and one forward over all of them trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.data.augment import PRESETS, ViewAugmenter
from unison.methods import EMPSSL, EMPSSLParams
from unison.training.resolve import resolve_recipe
from unison.training.step import data_spec


def test_patches_are_fixed_size_squares_and_their_number_is_the_parameter():
    cfg = TrainConfig(method="empssl", data="/data/images", method_params={"n_patches": 6})
    recipe = resolve_recipe(cfg)
    assert (recipe.augmentation, recipe.global_views) == ("patches", 6)
    assert resolve_recipe(TrainConfig(method="empssl")).augmentation == "digits_patches"
    assert resolve_recipe(TrainConfig(method="empssl", data="/data/images")).global_views == 20   # CIFAR-scale
    aug = ViewAugmenter("patches", 32, (0.5,) * 3, (0.25,) * 3, **data_spec(cfg, recipe.at_size(cfg, 32)).augment_overrides())
    assert aug.view_sizes == [32] * 6
    u = aug.uniforms(torch.arange(5), epoch=0, seed=0, view=3)
    width, height = aug.crop_fractions(u, 3, 32, 32)[:2]
    torch.testing.assert_close(width, torch.full((5,), 0.5, dtype=torch.float64))   # 16 px of 32: a quarter
    torch.testing.assert_close(height, width)
    assert PRESETS["patches"]["blur_off_at_or_below"] == 0   # the official code blurs its 32 px patches too


def test_a_forward_over_the_patches_trains():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model = EMPSSL(backbone, 4, EMPSSLParams(n_patches=4, proj_hidden_dim=8, proj_dim=4))
    loss = model([torch.randn(6, 3, 8, 8) for _ in range(4)])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="n_patches=4"):
        model([torch.randn(6, 3, 8, 8) for _ in range(3)])
