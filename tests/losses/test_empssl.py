"""EMPSSLLoss against the official code's formula written out patch by patch, and against Lightly's EMP-SSL pieces
(float64, 1e-9), with one stated difference: Lightly's ``EMPSSLLoss`` adds the coding rate (+logdet / 2) where the
paper's code subtracts it, so unison's loss is Lightly's minus twice Lightly's ``tcr_loss``. Its distributed form
(the coding rate of the global batch, W ranks == one process) is checked by `unison check` for every method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unison.losses import EMPSSLLoss


def _unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def _official(z: torch.Tensor, eps: float, inv_weight: float) -> float:
    """The official ``main.py``: TotalCodingRate (-logdet(I + d/(m eps) W W^T) / 2) averaged over the patches, and
    -mean cos(z_p, patch mean) averaged over the patches, weighted by patch_sim."""
    patches, m, d = z.shape
    tcr = sum(-torch.logdet(torch.eye(d, dtype=z.dtype) + d / (m * eps) * z[p].T @ z[p]) / 2 for p in range(patches))
    mean = z.mean(0)
    sim = sum(F.cosine_similarity(z[p], mean, dim=1).mean() for p in range(patches)) / patches
    return float(inv_weight * -sim + tcr / patches)


def test_empssl_loss_is_the_official_formula():
    z = _unit(5, 12, 6)
    assert EMPSSLLoss(0.2, 200.0)(z).item() == pytest.approx(_official(z, 0.2, 200.0), rel=1e-12)


def test_empssl_loss_agrees_with_lightly_with_the_papers_sign_of_the_coding_rate():
    emp = pytest.importorskip("lightly.loss.emp_ssl_loss")
    z = _unit(5, 12, 6, seed=1)
    ours = EMPSSLLoss(tcr_eps=0.2, inv_weight=200.0)
    assert abs(ours.invariance(z).item() - emp.invariance_loss(z).item()) < 1e-9
    assert abs(ours.tcr(z).item() - emp.tcr_loss(z, eps=0.2).item()) < 1e-9
    theirs = emp.EMPSSLLoss(tcr_eps=0.2, inv_coef=200.0)(list(z))
    assert abs(ours(z).item() - (theirs - 2 * emp.tcr_loss(z, eps=0.2)).item()) < 1e-9


def test_empssl_loss_gradient_matches_finite_differences():
    z = _unit(3, 6, 4, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: EMPSSLLoss(0.2, 2.0)(x), (z,), eps=1e-6, atol=1e-6)
