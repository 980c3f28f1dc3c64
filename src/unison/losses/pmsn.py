"""PMSN loss (Assran et al., 2023, "The hidden uniform cluster prior"): MSN with a power-law prior on the clusters.

MSN's mean-entropy maximisation is KL(p_bar || uniform): it asks every prototype to be used equally often, a
uniform cluster prior that suits class-balanced data. PMSN matches the mean prediction to a prior of its own
instead, a power law over the K prototypes:

    prior_k = k^(-tau) / sum_j j^(-tau),  k = 1..K                       (tau = 0.25; tau = 0: uniform, MSN)
    R       = KL(p_bar || prior) = sum_k p_bar_k (log p_bar_k - log prior_k)
    L       = CE + lambda R                                              CE, p_bar, lambda: `unison.losses.msn`

The prototypes carry no order, so which prototype gets which prior mass is arbitrary (each learns its share).

Direction of the divergence: KL(p_bar || prior), which is MSN's regulariser exactly when the prior is uniform (and
what Lightly's ``PMSNCustomLoss`` docstring names). Lightly 1.6.0's ``PMSNLoss`` computes
``F.kl_div(p_bar.log(), prior, reduction="sum")`` = KL(prior || p_bar), the other direction; its cross-entropy
term is the same as unison's (tests/losses/test_pmsn.py shows both).

Distributed semantics: as MSN's (`unison.losses.msn`): Sinkhorn over the global batch, p_bar the global mean
through ``all_reduce_with_grad``; each rank returns its local CE + lambda R.

Example::

    loss_fn = PMSNLoss(power_law_exponent=0.25)
    loss = loss_fn(anchor_embeddings, target_embeddings, prototypes.weight)
"""

from __future__ import annotations

import torch

from .msn import MSNLoss


def power_law_log_prior(size: int, exponent: float, like: torch.Tensor) -> torch.Tensor:
    """[size]: log of k^(-exponent) / sum_j j^(-exponent), k = 1..size, in `like`'s dtype and device. In log space,
    so that a steep prior over many prototypes does not underflow to a probability of 0."""
    log_k = torch.arange(1, size + 1, dtype=like.dtype, device=like.device).log()
    return -exponent * log_k - torch.logsumexp(-exponent * log_k, dim=0)


class PMSNLoss(MSNLoss):
    def __init__(self, temperature: float = 0.1, sinkhorn_iterations: int = 3, regularization_weight: float = 1.0,
                 power_law_exponent: float = 0.25, gather_distributed: bool = True):
        super().__init__(temperature, sinkhorn_iterations, regularization_weight, gather_distributed)
        if power_law_exponent < 0:
            raise ValueError(f"power_law_exponent must be >= 0, got {power_law_exponent}")
        self.power_law_exponent = power_law_exponent

    def regularizer(self, mean_probabilities: torch.Tensor) -> torch.Tensor:
        """KL(p_bar || power-law prior)."""
        log_prior = power_law_log_prior(mean_probabilities.numel(), self.power_law_exponent, mean_probabilities)
        return (torch.special.xlogy(mean_probabilities, mean_probabilities) - mean_probabilities * log_prior).sum()
