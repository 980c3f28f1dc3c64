"""PMSN (Assran et al., 2023, "The hidden uniform cluster prior"): MSN with a power-law prior on the clusters.

    everything as MSN (`unison.methods.msn`): masked anchor and focal views, EMA target network, prototypes,
    sharpened Sinkhorn-balanced targets
    loss = CE + lambda KL(p_bar || prior),  prior_k proportional to k^(-tau) over the K prototypes   (tau = 0.25)

MSN's mean-entropy maximisation, KL(p_bar || uniform), is a hidden prior that every prototype (cluster) is used
equally often; on class-imbalanced (long-tailed) data PMSN asks for a power-law usage instead
(`unison.losses.pmsn`, which also says how Lightly's ``PMSNLoss`` differs). ``power_law_exponent=0`` is MSN.

Defaults: MSN's, with the paper's exponent tau = 0.25 (and Lightly's ``PMSNLoss`` default); the recipe is MSN's.

Distributed semantics: MSN's: Sinkhorn over the global batch, p_bar the differentiable all-reduced global mean,
SyncBN in the head, masks from the sample keys. Exact with gather on.

Example::

    backbone, dim = build_backbone("vit_tiny_p4")
    model = PMSN(backbone, dim, PMSNParams(power_law_exponent=0.25), steps_total=10_000)
    loss = model([target_view, anchor_view, *focal_views], keys=SampleKeys(seed, epoch, indices))
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.config.fields import shown
from unison.errors import ConfigError
from unison.losses import MSNLoss, PMSNLoss

from .msn import MSN, MSNParams


@dataclass
class PMSNParams(MSNParams):
    power_law_exponent: float = 0.25     # paper (tau); 0: the uniform prior of MSN

    def __post_init__(self) -> None:
        super().__post_init__()
        tau = self.power_law_exponent
        if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not 0 <= tau < float("inf"):
            raise ConfigError(f"PMSN parameter power_law_exponent={shown(tau)} must be a finite number >= 0 (0: the "
                              "uniform prior of MSN) (--param power_law_exponent=VALUE)")


class PMSN(MSN):
    name = "pmsn"
    Params = PMSNParams

    def build_loss(self, params: MSNParams) -> MSNLoss:
        assert isinstance(params, PMSNParams)
        return PMSNLoss(params.temperature, params.sinkhorn_iterations, params.me_max_weight,
                        params.power_law_exponent, gather_distributed=self.gather_distributed)

    def exactness_note(self) -> str | None:
        if not self.gather_distributed:
            return "gather is off: Sinkhorn and the mean prediction (the prior's KL) use each rank's local batch"
        return None
