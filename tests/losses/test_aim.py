"""AIMLoss: the per-image mean squared error on the non-prefix patches against per-patch normalised pixels,
against the formula written out per image and patch, and against the loss of Lightly's AIM example (``nn.MSELoss``
on ``normalize_mean_var`` targets, every patch a target: prefix 0) to 1e-9 in float64."""

from __future__ import annotations

import pytest
import torch

from unison.losses import AIMLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_aim_loss_matches_the_formula():
    pred, patches, prefix = _rand(3, 6, 12, seed=1), _rand(3, 6, 12, seed=2), torch.tensor([1, 5, 3])
    per_image = []
    for i in range(3):
        errors = []
        for j in range(int(prefix[i]), 6):
            x = patches[i, j]
            target = (x - x.mean()) / (x.var(unbiased=True) + 1e-6).sqrt()
            errors.append(((pred[i, j] - target) ** 2).mean())
        per_image.append(sum(errors) / len(errors))
    torch.testing.assert_close(AIMLoss()(pred, patches, prefix), sum(per_image) / 3, rtol=1e-12, atol=1e-12)


def test_the_prefix_patches_are_not_predicted():
    pred, patches, prefix = _rand(2, 6, 12, seed=1).requires_grad_(), _rand(2, 6, 12, seed=2), torch.tensor([2, 4])
    AIMLoss()(pred, patches, prefix).backward()
    assert pred.grad is not None
    for i, k in enumerate(prefix.tolist()):
        assert not pred.grad[i, :k].any() and pred.grad[i, k:].abs().sum(dim=-1).min() > 0


def test_every_patch_a_target_equals_lightlys_example_loss():
    utils = pytest.importorskip("lightly.models.utils")
    pred, patches = _rand(4, 9, 12, seed=3), _rand(4, 9, 12, seed=4)
    theirs = torch.nn.MSELoss()(pred, utils.normalize_mean_var(patches, dim=-1))
    assert abs(float(AIMLoss()(pred, patches, torch.zeros(4, dtype=torch.long))) - float(theirs)) < 1e-9


def test_raw_pixel_targets_and_a_shape_mismatch():
    pred, patches = _rand(2, 4, 3, seed=5), _rand(2, 4, 3, seed=6)
    expected = ((pred - patches) ** 2).mean(dim=-1)[:, 1:].mean()
    torch.testing.assert_close(AIMLoss(norm_pix=False)(pred, patches, torch.tensor([1, 1])), expected)
    with pytest.raises(ValueError, match="prefix lengths"):
        AIMLoss()(pred, patches, torch.tensor([1]))
