"""SMoGLoss against Lightly's SMoGPrototypes as its CIFAR-10 benchmark uses them (the groups' synchronous update,
the assignments, the cross-entropy: values and gradients, float64, 1e-9). Its distributed form (W ranks == one
process, the groups identical on every rank) is checked by `unison check` for every method and, with resets, by
tests/methods/test_smog.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unison.losses import SMoGLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_smog_loss_agrees_with_lightly():
    heads = pytest.importorskip("lightly.models.modules.heads")
    k, n, d = 5, 24, 4
    groups = F.normalize(_rand(k, d), dim=1)
    online, prediction, momentum = (_rand(n, d, seed=s).requires_grad_(True) for s in (1, 2, 3))
    theirs = heads.SMoGPrototypes(group_features=groups.clone(), beta=0.99)
    their_targets = theirs.assign_groups(momentum)
    their_groups = theirs.get_updated_group_features(online)
    their_loss = F.cross_entropy(theirs(prediction, their_groups, temperature=0.1), their_targets)
    their_grads = torch.autograd.grad(their_loss, (online, prediction))

    ours = SMoGLoss(temperature=0.1, beta=0.99)
    targets = ours.assign(momentum, groups)
    moved = ours.grouped(online, groups)
    loss = ours(prediction, targets, moved)
    assert torch.equal(targets, their_targets)
    assert (moved - their_groups).abs().max().item() < 1e-9 and abs(loss.item() - their_loss.item()) < 1e-9
    for g, h in zip(torch.autograd.grad(loss, (online, prediction)), their_grads):
        assert (g - h).abs().max().item() < 1e-9


def test_groups_without_members_keep_their_features():
    groups = torch.eye(3, dtype=torch.float64)
    z = torch.tensor([[2.0, 0.1, 0.0], [3.0, 0.0, 0.2]], dtype=torch.float64)   # both nearest group 0
    moved = SMoGLoss(beta=0.9).grouped(z, groups)
    torch.testing.assert_close(moved[0], 0.9 * groups[0] + 0.1 * z.mean(0))
    torch.testing.assert_close(moved[1:], groups[1:])
