"""VICRegL loss: VICReg on the global embeddings plus VICReg on matched cells of the feature maps.

Views v = 0 .. V-1 of each image (the first `n_global` global, the rest local crops), each with a global embedding
z_v [n, D], a projected feature map m_v [n, L_v, C] (its L_v = h_v * w_v cells in raster order) and the cells'
locations p_v [n, L_v, 2] in the image's pixels (where each cell's centre lies in the image the views were cut from).
The pairs are P = {(a, b): a < n_global, b != a}. With the VICReg terms

    inv(x, y) = mean((x - y)^2)
    var(x)    = mean_{k, c} max(0, 1 - sqrt(Var_N(x[:, k, c]) + eps))        (unbiased, over the batch)
    cov(x)    = mean_k (1 / C) sum_{c != d} Cov_N(x[:, k])_cd^2              (x [N, K, C]; K = 1 for z_v)

the global criterion is VICReg's over the views (variance and covariance averaged over every view):

    G = lambda * mean_{(a, b) in P} inv(z_a, z_b) + mu * mean_v var(z_v) + nu * mean_v cov(z_v)

and the local criterion matches cells of the two maps of each pair twice, each way:

* by feature distance: every cell of m_a is paired with its nearest cell of m_b (L2 between the projected cells);
  all of m_a's cells are kept (``l2_all_matches``, the official code's default), else the `num_matches` pairs of
  smallest distance; from m_b to m_a likewise with `num_matches_back`;
* by location: every cell of m_a is paired with the cell of m_b whose centre lies nearest in the image (p_a, p_b),
  and the `num_matches` (20) pairs of smallest distance kept; from m_b to m_a the `num_matches_back` (4) nearest.

Each set of matched cells (x, y) [n, K, C] (kept in order of increasing distance, ties by cell index) is scored by

    l(x, y) = lambda * inv(x, y) + mu * (var(x) + var(y)) / 2 + nu * (cov(x) + cov(y)) / 2

(variance and covariance per match rank k over the batch), each matching by the mean of its two directions, and

    L_local = mean_{(a, b) in P} [ (l(l2: a->b) + l(l2: b->a)) / 2 + (l(loc: a->b) + l(loc: b->a)) / 2 ]
    L       = alpha * G + (1 - alpha) * L_local

with lambda = mu = 25, nu = 1, eps = 1e-4, alpha = 0.75, 20 / 4 matches (Bardes et al., 2022, and their code
``facebookresearch/VICRegL``: its local loss, its weighting, its covariance halved against VICReg's). Deliberate
differences from that code: the local terms of the pairs are averaged (theirs keeps the last pair's, an overwritten
accumulator), and matched cells are ordered by distance (theirs: by cell index), as Lightly's ``VICRegLLoss``,
which this loss equals to 1e-9 with ``l2_all_matches=False`` (tests/losses/test_vicregl.py).

Distributed semantics (``gather_distributed=True``)
--------------------------------------------------
Matching is per image (a cell's partner is in the other view of the same image), so the matches of a rank's
images are made on that rank. The invariance terms are means over this rank's images; every variance and
covariance, global and local, is over the global batch: the global embeddings and every matched set of every rank
are gathered in ONE `all_gather_with_grad` (concatenated along the features) and the statistics are computed on the
gathered rows, the same on every rank. Rank r returns alpha * G_r + (1 - alpha) * L_r, whose invariance parts are its
local means and whose statistics appear once, undivided: as in `unison.losses.vicreg`, the mean over ranks is the
global-batch loss and DDP's average of the gradients (the gather's backward sums over ranks) is its gradient. A
variance over the batch does not depend on the order of the rows, so the gathered order needs no care.

Example::

    loss_fn = VICRegLLoss()
    loss = loss_fn([z_a, z_b], [m_a, m_b], [p_a, p_b])   # z [n, D], m [n, L, C], p [n, L, 2]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from unison.distributed.collectives import all_gather_with_grad, world_size

from ._precision import in_full_precision

__all__ = ["VICRegLLoss", "nearest_matches"]


def nearest_matches(inputs: torch.Tensor, candidates: torch.Tensor, distances: torch.Tensor,
                    k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cells of `inputs`, their nearest cells of `candidates`), each [n, k, C]: every cell of `inputs` [n, L, C] is
    paired with the cell of `candidates` [n, M, C] at the smallest of `distances` [n, L, M] (the first such cell), and
    the `k` pairs of smallest distance are kept (None or k >= L: all L), in order of increasing distance, ties by cell
    index. The selection carries no gradient; the cells do."""
    with torch.no_grad():
        nearest, partner = distances.min(dim=2)             # the first minimal index
        keep = inputs.shape[1] if k is None else min(k, inputs.shape[1])
        order = torch.sort(nearest, dim=1, stable=True).indices[:, :keep]
        partner = partner.gather(1, order)
    width = inputs.shape[-1]
    return (inputs.gather(1, order[..., None].expand(-1, -1, width)),
            candidates.gather(1, partner[..., None].expand(-1, -1, candidates.shape[-1])))


def _location_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, L, M] squared distances between the cell centres a [n, L, 2] and b [n, M, 2], elementwise: the same bits
    whatever the batch (ties between cells, frequent on regular grids, then break the same way at every world
    size). Squared: the order of the distances is what matching reads."""
    return (a[:, :, None, :] - b[:, None, :, :]).pow(2).sum(-1)


class VICRegLLoss(nn.Module):
    def __init__(self, lambda_inv: float = 25.0, mu_var: float = 25.0, nu_cov: float = 1.0, alpha: float = 0.75,
                 num_matches: int = 20, num_matches_back: int = 4, l2_all_matches: bool = True, eps: float = 1e-4,
                 gather_distributed: bool = True):
        super().__init__()
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.lambda_inv, self.mu_var, self.nu_cov, self.alpha = lambda_inv, mu_var, nu_cov, alpha
        self.num_matches, self.num_matches_back, self.l2_all_matches = num_matches, num_matches_back, l2_all_matches
        self.eps, self.gather_distributed = eps, gather_distributed

    def forward(self, embeddings: Sequence[torch.Tensor] | None, maps: Sequence[torch.Tensor] | None,
                locations: Sequence[torch.Tensor] | None, n_global: int = 2) -> torch.Tensor:
        """`embeddings`: z_v [n, D] per view (None: alpha = 0); `maps`: m_v [n, L_v, C] and `locations`: p_v
        [n, L_v, 2] per view (None: alpha = 1); the first `n_global` views are the global ones."""
        z, m, p = list(embeddings or ()), list(maps or ()), list(locations or ())
        if self.alpha > 0 and not z:
            raise ValueError(f"VICRegL with alpha={self.alpha} needs the views' global embeddings")
        if self.alpha < 1 and (not m or len(p) != len(m)):
            raise ValueError(f"VICRegL with alpha={self.alpha} needs every view's feature map and cell locations")
        views = len(z or m)
        if (z and len(z) != views) or (m and len(m) != views) or not 1 <= n_global <= views or views < 2:
            raise ValueError(f"VICRegL needs 2 or more views, the same for every input, and 1 to all of them global: "
                             f"got {len(z)} embeddings, {len(m)} maps, n_global={n_global}")
        for mv, pv in zip(m, p):
            if mv.dim() != 3 or pv.shape != (*mv.shape[:2], 2):
                raise ValueError(f"a map must be [n, cells, C] with locations [n, cells, 2], got {tuple(mv.shape)} "
                                 f"and {tuple(pv.shape)}")
        loss = functools.partial(self._loss, len(z), len(m), n_global)
        return in_full_precision(loss, *z, *m, *p)   # batch statistics: float32 under AMP

    def _loss(self, n_z: int, n_m: int, n_global: int, *tensors: torch.Tensor) -> torch.Tensor:
        z, m, p = list(tensors[:n_z]), list(tensors[n_z:n_z + n_m]), list(tensors[n_z + n_m:])
        views = max(n_z, n_m)
        pairs = [(a, b) for a in range(n_global) for b in range(views) if b != a]
        matched: list[tuple[torch.Tensor, torch.Tensor]] = []   # per pair: l2 a->b, b->a, location a->b, b->a
        for a, b in pairs if m else ():
            with torch.no_grad():
                features = torch.cdist(m[a], m[b])
                places = _location_distances(p[a], p[b])
            k, k_back = (None, None) if self.l2_all_matches else (self.num_matches, self.num_matches_back)
            matched += [nearest_matches(m[a], m[b], features, k),
                        nearest_matches(m[b], m[a], features.transpose(1, 2), k_back),
                        nearest_matches(m[a], m[b], places, self.num_matches),
                        nearest_matches(m[b], m[a], places.transpose(1, 2), self.num_matches_back)]
        everything = self._global_batch([*z, *(t for xy in matched for t in xy)])
        z_all, matched_all = everything[:n_z], everything[n_z:]
        total = z[0].new_zeros(()) if z else m[0].new_zeros(())
        if z and self.alpha > 0:
            inv = torch.stack([F.mse_loss(z[a], z[b]) for a, b in pairs]).mean()
            var = torch.stack([self._variance(x) for x in z_all]).mean()
            cov = torch.stack([self._covariance(x) for x in z_all]).mean()
            total = total + self.alpha * (self.lambda_inv * inv + self.mu_var * var + self.nu_cov * cov)
        if m and self.alpha < 1:
            terms = [self._local(x, y, matched_all[2 * i], matched_all[2 * i + 1]) for i, (x, y) in enumerate(matched)]
            per_pair = [0.5 * (terms[i] + terms[i + 1]) + 0.5 * (terms[i + 2] + terms[i + 3])
                        for i in range(0, len(terms), 4)]
            total = total + (1 - self.alpha) * torch.stack(per_pair).mean()
        return total

    def _local(self, x: torch.Tensor, y: torch.Tensor, x_all: torch.Tensor, y_all: torch.Tensor) -> torch.Tensor:
        """l(x, y): the invariance over this rank's matched cells, the statistics over the gathered ones."""
        return (self.lambda_inv * F.mse_loss(x, y) + self.mu_var * 0.5 * (self._variance(x_all) + self._variance(y_all))
                + self.nu_cov * 0.5 * (self._covariance(x_all) + self._covariance(y_all)))

    def _global_batch(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` (each [n, ...]) over the global batch: one differentiable gather of all of them."""
        if not tensors or not (self.gather_distributed and world_size() > 1):
            out = tensors
        else:
            flat = [t.flatten(1) for t in tensors]
            gathered = all_gather_with_grad(torch.cat(flat, dim=1))
            out = [g.view(-1, *t.shape[1:]) for g, t in zip(gathered.split([f.shape[1] for f in flat], dim=1), tensors)]
        if out and out[0].shape[0] < 2:
            raise ValueError("VICRegL needs at least 2 samples in the (global) batch for variance and covariance")
        return out

    def _variance(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(1 - torch.sqrt(x.var(dim=0) + self.eps)).mean()

    @staticmethod
    def _covariance(x: torch.Tensor) -> torch.Tensor:
        """mean over the leading cells of (1 / C) * sum of the squared off-diagonal covariances over the batch."""
        n, c = x.shape[0], x.shape[-1]
        centred = (x - x.mean(dim=0)).reshape(n, -1, c)                          # [N, K, C]
        cov = torch.einsum("nkc,nkd->kcd", centred, centred) / (n - 1)           # [K, C, C]
        eye = torch.eye(c, dtype=torch.bool, device=x.device)
        return (cov.masked_fill(eye, 0).pow(2).sum(dim=(1, 2)) / c).mean()
