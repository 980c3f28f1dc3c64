"""LeJEPA loss: view prediction plus SIGReg, the sketched isotropic-Gaussian regulariser (Balestriero & LeCun, 2025).

Embeddings z_v [N, K] of V views (the first V_g global) of the N samples of the global batch:

    pred   = mean over v, samples n, dimensions k of (c_nk - z_vnk)^2,   c_n = mean over global views of z_vn
    SIGReg = mean over v of  (1/M) sum_m EP({a_m^T z_vn}_n)               a_m: M random unit directions
    L      = (1 - lambda) * pred + lambda * SIGReg                        (lambda = 0.05)

Epps-Pulley statistic of N univariate samples x_n against N(0, 1), with the empirical
characteristic function phi_N(t) = (1/N) sum_n exp(i t x_n) and phi(t) = exp(-t^2 / 2):

    EP = N * integral |phi_N(t) - phi(t)|^2 phi(t) dt
       = N * sum_k w_k [((1/N) sum_n cos(t_k x_n) - phi(t_k))^2 + ((1/N) sum_n sin(t_k x_n))^2] phi(t_k)

with the trapezoid rule on 17 points of [-5, 5] (the paper's Algorithm 1; the reference
package integrates [0, 3] and doubles, which is the same integrand on a shorter range).
The directions are drawn afresh every step from (seed, step) (`sigreg_directions`), the same
on every rank, as the paper's generator seeded with the global step.

Distributed semantics (``gather_distributed=True``): the N in EP and in the empirical
characteristic function is the GLOBAL batch. Each rank sums cos(t x_n) and sin(t x_n) over
its local samples and ONE `all_reduce_with_grad` of [sums, count] gives the global sums, so
every rank computes the same SIGReg value S. Its loss is (1 - lambda) * pred_r + lambda * S,
pred_r the mean over its local samples; the mean over ranks is L. Gradient: DDP averages the
ranks' gradients, and the all-reduce's backward sums each rank's incoming gradient over the
ranks, so rank r holds W * dS/dz_r and the average is exactly dS/dtheta (the argument of
`unison.losses.barlowtwins`). Lightly's SIGReg averaged the characteristic function with an
all-reduce whose backward did not sum over ranks, which left the gradient 1/W of the true
one (lightly#1920); the paper's own snippet has the same non-differentiable all-reduce.
With ``gather_distributed=False`` each rank tests its local batch only (a different loss).

Example::

    loss_fn = LeJEPALoss(lambd=0.05)
    a = sigreg_directions(seed=0, step=step, dim=128, num_slices=256, device=z.device, dtype=z.dtype)
    loss = loss_fn(torch.stack(z_per_view), n_global=2, directions=a)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from unison.distributed.collectives import all_reduce_with_grad, world_size
from unison.rng import sample_normal

_DIRECTION_STREAM = 0x51_6E_E6   # counter-based RNG stream of the SIGReg directions


def sigreg_directions(seed: int, step: int, dim: int, num_slices: int, device: torch.device | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[dim, num_slices] unit columns: Gaussian directions, a pure function of (seed, step)."""
    a = sample_normal(seed, step, torch.arange(dim), _DIRECTION_STREAM, num_slices).to(device=device, dtype=dtype)
    return a / a.norm(dim=0, keepdim=True)


class SIGRegLoss(nn.Module):
    """mean over views and directions of the Epps-Pulley statistic of the projected global batch."""

    t: torch.Tensor
    phi: torch.Tensor
    weights: torch.Tensor

    def __init__(self, knots: int = 17, t_max: float = 5.0, gather_distributed: bool = True):
        super().__init__()
        if knots < 2 or t_max <= 0:
            raise ValueError(f"SIGReg needs knots >= 2 and t_max > 0, got {knots} and {t_max}")
        t = torch.linspace(-t_max, t_max, knots, dtype=torch.float64)
        trapezoid = torch.full((knots,), 2 * t_max / (knots - 1), dtype=torch.float64)
        trapezoid[[0, -1]] /= 2
        phi = torch.exp(-0.5 * t * t)
        self.register_buffer("t", t, persistent=False)
        self.register_buffer("phi", phi, persistent=False)
        self.register_buffer("weights", trapezoid * phi, persistent=False)    # quadrature x Gaussian window
        self.gather_distributed = gather_distributed

    def forward(self, z: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """z: [V, n, K] (views of this rank's samples), directions: [K, M] -> scalar."""
        if z.dim() != 3 or directions.dim() != 2 or directions.shape[0] != z.shape[-1]:
            raise ValueError(f"expected z [V, n, K] and directions [K, M], got {tuple(z.shape)} and "
                             f"{tuple(directions.shape)}")
        if z.dtype in (torch.float16, torch.bfloat16):      # cos / sin of projections need float32 under AMP
            z = z.float()
        with torch.autocast(z.device.type, enabled=False):
            return self._statistic(z, directions.to(z.dtype))

    def _statistic(self, z: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        t, phi, weights = (b.to(z.dtype) for b in (self.t, self.phi, self.weights))
        x_t = (z @ directions).unsqueeze(-1) * t                          # [V, n, M, T]
        sums = torch.stack([x_t.cos().sum(dim=1), x_t.sin().sum(dim=1)])  # [2, V, M, T]
        count = z.new_full((1,), float(z.shape[1]))
        if self.gather_distributed and world_size() > 1:
            flat = all_reduce_with_grad(torch.cat([sums.reshape(-1), count]))
            sums, count = flat[:-1].view_as(sums), flat[-1:].detach()
        ecf_real, ecf_imag = sums / count
        err = (ecf_real - phi).square() + ecf_imag.square()
        statistic = (err @ weights) * count                                # [V, M]
        return statistic.mean()


class LeJEPALoss(nn.Module):
    """(1 - lambd) * view prediction + lambd * SIGReg; see the module docstring."""

    def __init__(self, lambd: float = 0.05, knots: int = 17, t_max: float = 5.0, gather_distributed: bool = True):
        super().__init__()
        if not 0 <= lambd <= 1:
            raise ValueError(f"lambd must be in [0, 1], got {lambd}")
        self.lambd = lambd
        self.sigreg = SIGRegLoss(knots, t_max, gather_distributed)

    def forward(self, z: torch.Tensor, n_global: int, directions: torch.Tensor) -> torch.Tensor:
        """z: [V, n, K], the first `n_global` views global; directions: [K, M]."""
        if not 1 <= n_global <= z.shape[0]:
            raise ValueError(f"n_global must be in [1, {z.shape[0]}], got {n_global}")
        centres = z[:n_global].mean(dim=0)                                 # [n, K], with gradient (no stop-grad)
        prediction = (centres - z).square().mean()
        return (1 - self.lambd) * prediction + self.lambd * self.sigreg(z, directions)
