"""Mixup and CutMix for fine-tuning, drawn per (seed, epoch, index) so that W workers mix like one.

timm's ``Mixup`` (what MAE's fine-tuning uses) mixes each batch with its own reverse and draws one mixing weight
per batch from the global generator: which two images are mixed, and how, would then depend on how the global
batch is split over the ranks. Here the samples of each global batch are mixed in **pairs of neighbours**
(positions 2k and 2k + 1), and everything about a pair is drawn from the index of its first sample
(`unison.rng.sample_uniform`):

* mixup or cutmix (both asked for: each with probability 0.5, as timm's ``switch_prob``);
* the weight ``lam ~ Beta(alpha, alpha)``, as the inverse of Beta's distribution function at a uniform draw
  (``scipy.special.betaincinv``: exact, and the same on every device);
* cutmix's box: side ``sqrt(1 - lam)`` of the image's, centre uniform, clipped to the image; ``lam`` is then the
  share of the image outside the box, as timm's ``correct_lam``.

Sample 2k becomes ``lam x_2k + (1 - lam) x_2k+1`` (cutmix: x_2k with x_2k+1 in the box), sample 2k + 1 the
mirror image, and each target ``lam t(y_2k) + (1 - lam) t(y_2k+1)`` with ``t`` the label-smoothed one-hot vector.
Every rank's share of a global batch is a run of whole pairs when the global batch is a multiple of twice the
world size (`check_pairs`), so a pair never straddles two ranks, and the mixed batch is the same at any world size.

Example::

    mixer = PairMixer(mixup=0.8, cutmix=1.0, label_smoothing=0.1, num_classes=10, seed=0)
    x, soft_targets = mixer(x, labels, indices, epoch)      # soft_targets None when both are 0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unison.errors import ConfigError
from unison.rng import sample_uniform

__all__ = ["MIX_STREAM", "PairMixer", "check_pairs"]

MIX_STREAM = 0x313C   # the uniforms of a pair: switch, lam, box centre y, box centre x


def check_pairs(global_batch: int, world: int) -> None:
    """One line when the ranks' shares of a global batch are not whole pairs."""
    if global_batch % (2 * world):
        raise ConfigError(f"--mixup/--cutmix mix neighbouring samples in pairs, so each of the {world} worker(s) needs "
                          f"an even share of the global batch, and {global_batch} is not a multiple of {2 * world}: "
                          f"give --train-batch-size a multiple of {2 * world}")


class PairMixer:
    """Mixes a rank's batch in pairs of neighbours (see the module docstring); the identity when both are 0."""

    def __init__(self, mixup: float, cutmix: float, label_smoothing: float, num_classes: int, seed: int):
        self.mixup, self.cutmix = float(mixup), float(cutmix)
        self.smoothing, self.num_classes, self.seed = float(label_smoothing), num_classes, seed

    @property
    def active(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor,
                 epoch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.active:
            return x, None
        if x.shape[0] % 2:
            raise ConfigError(f"--mixup/--cutmix: a worker's batch of {x.shape[0]} samples cannot be split into pairs; "
                              "give --train-batch-size a multiple of twice the workers")
        u = sample_uniform(self.seed, epoch, indices[0::2].cpu(), MIX_STREAM, 4).double()
        use_cut = self._use_cutmix(u[:, 0])
        alpha = torch.where(use_cut, self.cutmix, self.mixup)
        lam = _beta_quantile(alpha, u[:, 1])
        a, b = x[0::2], x[1::2]
        H, W = x.shape[-2:]
        box = _boxes(use_cut, lam, u[:, 2], u[:, 3], H, W).to(x.device)   # [P, 1, H, W]: True inside the box
        lam = torch.where(use_cut, 1 - box.double().mean(dim=(1, 2, 3)).cpu(), lam)
        w = lam.to(x.device, x.dtype).view(-1, 1, 1, 1)
        mixed_a = torch.where(box, b, torch.where(use_cut.to(x.device).view(-1, 1, 1, 1), a, w * a + (1 - w) * b))
        mixed_b = torch.where(box, a, torch.where(use_cut.to(x.device).view(-1, 1, 1, 1), b, w * b + (1 - w) * a))
        out = torch.stack((mixed_a, mixed_b), dim=1).reshape(x.shape)
        t = F.one_hot(y, self.num_classes).to(torch.float64) * (1 - self.smoothing) + self.smoothing / self.num_classes
        ta, tb = t[0::2], t[1::2]
        lt = lam.to(t.device).view(-1, 1)
        target = torch.stack((lt * ta + (1 - lt) * tb, lt * tb + (1 - lt) * ta), dim=1).reshape(t.shape)
        return out, target

    def _use_cutmix(self, u: torch.Tensor) -> torch.Tensor:
        if self.mixup > 0 and self.cutmix > 0:
            return u < 0.5
        return torch.full_like(u, self.cutmix > 0, dtype=torch.bool)


def _beta_quantile(alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Beta(alpha, alpha) quantile of `u` (float64, CPU); alpha 0 gives 1 (no mixing)."""
    from scipy.special import betaincinv

    a = alpha.clamp_min(1e-12).numpy()
    lam = torch.from_numpy(betaincinv(a, a, u.clamp(1e-12, 1 - 1e-12).numpy()))
    return torch.where(alpha > 0, lam, torch.ones_like(lam))


def _boxes(use_cut: torch.Tensor, lam: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """[P, 1, H, W] masks of cutmix's boxes (all False for a pair that mixes by mixup)."""
    cut = torch.sqrt(1 - lam)
    h, w = (cut * H).floor(), (cut * W).floor()
    y0, x0 = (cy * H - h / 2).round().clamp(0, H), (cx * W - w / 2).round().clamp(0, W)
    y1, x1 = (cy * H + h / 2).round().clamp(0, H), (cx * W + w / 2).round().clamp(0, W)
    rows = torch.arange(H, dtype=torch.float64)
    cols = torch.arange(W, dtype=torch.float64)
    inside_y = (rows[None] >= y0[:, None]) & (rows[None] < y1[:, None])
    inside_x = (cols[None] >= x0[:, None]) & (cols[None] < x1[:, None])
    box = inside_y[:, :, None] & inside_x[:, None, :] & use_cut[:, None, None]
    return box[:, None]
