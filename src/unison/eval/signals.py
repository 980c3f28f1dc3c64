"""Label-free quality signals of an embedding matrix: plain tensors in, floats out.

With ``Z`` the ``[N, d]`` embeddings of N images (rows), ``z_i = Z_i / ||Z_i||`` the L2-normalised rows,
and ``(x_i, y_i)`` the normalised embeddings of two augmented views of image i:

* **RankMe** (Garrido et al., "RankMe: Assessing the downstream performance of pretrained self-supervised
  representations by their rank", ICML 2023, eq. 1): with ``s_k`` the singular values of ``Z`` (unnormalised,
  as in the paper), ``p_k = s_k / sum_j s_j + eps`` (eps = 1e-7, the paper's) and
  ``RankMe = exp(-sum_k p_k log p_k)``: the effective rank, between 1 (every image on one line) and
  ``min(N, d)`` (a flat spectrum). `rankme`.
* **Embedding std** (Chen & He, "Exploring simple Siamese representation learning", CVPR 2021, §4.1, the
  collapse indicator; VICReg's variance term watches the same quantity): ``std_d(z)``, the standard deviation
  over the N images of each dimension of the normalised embeddings, averaged over the d dimensions. For
  embeddings spread uniformly over the unit sphere it is ``1/sqrt(d)``; for a collapsed (constant) embedding
  it is 0. `embedding_std` returns it times ``sqrt(d)``, so 1 means healthy and 0 collapsed whatever d is.
* **Alignment** and **uniformity** (Wang & Isola, "Understanding contrastive representation learning through
  alignment and uniformity on the hypersphere", ICML 2020, with their alpha = 2, t = 2):
  ``align = mean_i ||x_i - y_i||^2`` (0 = the two views embed identically; a collapsed encoder also gives 0)
  and ``uniform = log mean_{i<j} exp(-2 ||x_i - x_j||^2)``, averaged over the two views
  (down to about -4 on a 128-d sphere: lower is more uniform; 0 = every image in one point).

Everything is computed in float64 on the whole matrix, so every rank that holds the same matrix gets the
same numbers (`unison.training.signals` gathers it in a world-size-independent order).

Example::

    z = torch.randn(512, 64)
    rankme(z), embedding_std(z)           # about 55 (of 64) and about 1.0
    alignment(z, z), uniformity(z)        # 0.0 and about -3.9
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RANKME_EPS = 1e-7   # Garrido et al. 2023, eq. 1
UNIFORMITY_T = 2.0  # Wang & Isola 2020
ALIGNMENT_ALPHA = 2


def rankme(z: torch.Tensor, eps: float = RANKME_EPS) -> float:
    """exp of the entropy of the L1-normalised singular values of `z` [N, d] (module docstring)."""
    s = torch.linalg.svdvals(z.double())
    p = s / s.sum().clamp_min(torch.finfo(torch.float64).tiny) + eps
    return float(torch.exp(-(p * p.log()).sum()))


def embedding_std(z: torch.Tensor) -> float:
    """sqrt(d) x the mean over dimensions of the per-dimension std of the L2-normalised rows of `z` [N, d]."""
    zn = F.normalize(z.double(), dim=1)
    return float(zn.std(dim=0, correction=0).mean() * math.sqrt(z.shape[1]))


def alignment(x: torch.Tensor, y: torch.Tensor, alpha: int = ALIGNMENT_ALPHA) -> float:
    """mean ||x_i - y_i||^alpha of the L2-normalised rows of two views `x`, `y` [N, d]."""
    xn, yn = F.normalize(x.double(), dim=1), F.normalize(y.double(), dim=1)
    return float((xn - yn).norm(dim=1).pow(alpha).mean())


def uniformity(x: torch.Tensor, t: float = UNIFORMITY_T) -> float:
    """log mean_{i<j} exp(-t ||x_i - x_j||^2) of the L2-normalised rows of `x` [N, d] (N >= 2)."""
    xn = F.normalize(x.double(), dim=1)
    sq = torch.pdist(xn, p=2).pow(2)
    if sq.numel() == 0:
        return 0.0
    # log-mean-exp, stable: the largest term is exp(0) at most
    return float(torch.logsumexp(-t * sq, dim=0) - math.log(sq.numel()))


def all_signals(eval_view: torch.Tensor, view_a: torch.Tensor, view_b: torch.Tensor) -> dict[str, float]:
    """The four signals: RankMe and std of the un-augmented embeddings, alignment and uniformity of two views."""
    return {"rankme": rankme(eval_view), "emb_std": embedding_std(eval_view),
            "align": alignment(view_a, view_b), "uniform": (uniformity(view_a) + uniformity(view_b)) / 2}
