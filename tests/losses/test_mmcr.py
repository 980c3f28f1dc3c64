"""MMCRLoss against the paper's formula written out image by image, against Lightly's MMCRLoss (float64, 1e-9), and
its gradient by finite differences. Its distributed form (W ranks == one process) is checked by `unison check`
for every method (tests/parallel, tests/equivalence)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unison.losses import MMCRLoss


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _formula(z: torch.Tensor, lam: float) -> float:
    """-||C||_* + lam / N sum_i ||Z_i||_*, the centroid of each image's unit-norm views, with numpy's SVD."""
    views = [[(z[v, i] / z[v, i].norm()).numpy() for v in range(z.shape[0])] for i in range(z.shape[1])]
    centroids = np.stack([np.mean(image, axis=0) for image in views])
    local = sum(np.linalg.svd(np.stack(image), compute_uv=False).sum() for image in views) / len(views)
    return float(-np.linalg.svd(centroids, compute_uv=False).sum() + lam * local)


@pytest.mark.parametrize("lam", [0.0, 5e-3])
def test_mmcr_loss_is_the_nuclear_norm_of_the_centroids(lam):
    z = _rand(4, 6, 5)                                      # 4 views of 6 images, 5 wide
    assert MMCRLoss(lam)(z).item() == pytest.approx(_formula(z, lam), rel=1e-12)


@pytest.mark.parametrize("lam", [0.0, 5e-3])
def test_mmcr_loss_agrees_with_lightly(lam):
    """Lightly's MMCRLoss takes [n, k, d] of an online and a momentum network, unnormalised, and centres over both:
    the same loss when each is half of the views, normalised (the row order of a matrix leaves its singular values)."""
    lightly_loss = pytest.importorskip("lightly.loss").MMCRLoss
    z = _rand(6, 8, 5, seed=1)
    unit = F.normalize(z, dim=-1).transpose(0, 1)          # [n, k, d]
    theirs = lightly_loss(lmda=lam)(unit[:, :3], unit[:, 3:])
    assert abs(MMCRLoss(lam)(z).item() - theirs.item()) < 1e-9


def test_mmcr_loss_gradient_matches_finite_differences():
    z = _rand(3, 5, 4, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: MMCRLoss(1e-2)(x), (z,), eps=1e-6, atol=1e-7)


def test_mmcr_loss_refuses_a_flat_batch():
    with pytest.raises(ValueError, match=r"\[views, n, d\]"):
        MMCRLoss()(_rand(6, 5))
