"""PMSNLoss: MSN's cross-entropy plus KL(p_bar || power-law prior), checked against the formula, against MSN at
exponent 0, and against Lightly 1.6.0 (1e-9, float64), whose PMSNLoss takes the divergence the other way round,
KL(prior || p_bar): the deliberate difference is stated in unison.losses.pmsn and pinned here."""

from __future__ import annotations

import pytest
import torch

from unison.losses import MSNLoss, PMSNLoss
from unison.losses.pmsn import power_law_log_prior


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs():
    return _rand(18, 8, seed=1), _rand(6, 8, seed=2), _rand(10, 8, seed=3)


def _mean_prediction(anchors, prototypes, tau=0.1):
    a = torch.nn.functional.normalize(anchors, dim=1)
    p = torch.nn.functional.normalize(prototypes, dim=1)
    return torch.softmax(a @ p.T / tau, dim=1).mean(dim=0)


def _power_law(k: int, tau: float) -> torch.Tensor:
    prior = torch.tensor([j ** -tau for j in range(1, k + 1)], dtype=torch.float64)
    return prior / prior.sum()


def test_the_prior_is_a_normalised_power_law():
    log_prior = power_law_log_prior(10, 0.25, torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(log_prior.exp(), _power_law(10, 0.25), rtol=1e-14, atol=0)
    steep = power_law_log_prior(2**20, 50.0, torch.zeros(()))       # log space: no probability underflows to 0
    assert torch.isfinite(steep).all()


@pytest.mark.parametrize("tau", [0.25, 1.0])
def test_pmsn_loss_is_msns_cross_entropy_plus_kl_to_the_prior(tau):
    a, t, p = _inputs()
    ce = MSNLoss(regularization_weight=0)(a, t, p)
    mean, prior = _mean_prediction(a, p), _power_law(10, tau)
    kl = sum(m * (m / q).log() for m, q in zip(mean, prior))
    torch.testing.assert_close(PMSNLoss(power_law_exponent=tau, regularization_weight=0.5)(a, t, p), ce + 0.5 * kl,
                               rtol=1e-12, atol=1e-12)


def test_exponent_zero_is_msn():
    a, t, p = _inputs()
    torch.testing.assert_close(PMSNLoss(power_law_exponent=0.0)(a, t, p), MSNLoss()(a, t, p), rtol=1e-13, atol=1e-13)


def test_pmsn_loss_against_lightlys():
    """Lightly's cross-entropy is unison's (regularization_weight=0: equal to 1e-9); its regulariser is
    KL(prior || p_bar), unison's KL(p_bar || prior): each side equals its own formula, unison's to 1e-9, Lightly's
    to 1e-6 (it computes its prior, and the prior's log in ``F.kl_div``, in float32: ``torch.arange`` of integers
    to a float power)."""
    lightly = pytest.importorskip("lightly.loss")
    a, t, p = _inputs()
    no_prior = [PMSNLoss(regularization_weight=0)(a, t, p), lightly.PMSNLoss(regularization_weight=0)(a, t, p)]
    assert abs(float(no_prior[0]) - float(no_prior[1])) < 1e-9
    mean, prior = _mean_prediction(a, p), _power_law(10, 0.25)
    forward_kl = (mean * (mean / prior).log()).sum()
    reverse_kl = (prior * (prior / mean).log()).sum()
    assert abs(float(PMSNLoss()(a, t, p)) - float(no_prior[0] + forward_kl)) < 1e-9
    assert abs(float(lightly.PMSNLoss()(a, t, p)) - float(no_prior[1] + reverse_kl)) < 1e-6
    assert abs(float(forward_kl - reverse_kl)) > 1e-6     # the two directions differ on these inputs


def test_a_negative_exponent_is_refused():
    with pytest.raises(ValueError, match="power_law_exponent"):
        PMSNLoss(power_law_exponent=-1.0)
