"""SimMIMLoss: the L1 on the masked pixels, against the official formula (summed errors over the masked pixels of the
batch, divided by their count and the channels) and against the loss of Lightly's SimMIM example (``nn.L1Loss``
on Lightly's ``patchify`` of the same images, gathered at the same patches), 1e-9 in float64."""

from __future__ import annotations

import pytest
import torch

from unison.losses import SimMIMLoss, patchify


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_simmim_loss_matches_the_official_pixel_formula():
    images, recon = _rand(3, 3, 8, 8, seed=1), _rand(3, 3, 8, 8, seed=2)
    patch, masked = 2, torch.tensor([[0, 3, 5, 6], [1, 2, 9, 15], [4, 7, 8, 12]])     # 4 of 16 patches each
    grid_mask = torch.zeros(3, 16).scatter_(1, masked, 1.0).view(3, 4, 4)
    pixel_mask = grid_mask.repeat_interleave(patch, 1).repeat_interleave(patch, 2).unsqueeze(1).double()
    official = ((images - recon).abs() * pixel_mask).sum() / pixel_mask.sum() / 3      # official, without its 1e-5
    at = masked.unsqueeze(-1).expand(-1, -1, patch * patch * 3)
    ours = SimMIMLoss()(patchify(recon, patch).gather(1, at), patchify(images, patch).gather(1, at))
    torch.testing.assert_close(ours, official, rtol=1e-12, atol=1e-12)


def test_simmim_loss_equals_lightlys_example_loss():
    utils = pytest.importorskip("lightly.models.utils")
    images, pred = _rand(4, 3, 8, 8, seed=3), _rand(4, 6, 12, seed=4)
    masked = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:6] for i in range(4)])
    target = patchify(images, 2).gather(1, masked.unsqueeze(-1).expand(-1, -1, 12))
    theirs = torch.nn.L1Loss()(pred, utils.get_at_index(utils.patchify(images, 2), masked))
    assert abs(float(SimMIMLoss()(pred, target)) - float(theirs)) < 1e-9


def test_targets_carry_no_gradient_and_shapes_must_match():
    pred, target = _rand(2, 3, 12).requires_grad_(), _rand(2, 3, 12, seed=1).requires_grad_()
    SimMIMLoss()(pred, target).backward()
    assert pred.grad is not None and target.grad is None
    with pytest.raises(ValueError, match="one shape"):
        SimMIMLoss()(pred, target[:, :2])
