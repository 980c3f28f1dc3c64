"""Linear probe: a linear classifier trained on frozen backbone features, top-1 on held-out data.

Protocol (fast on CPU): the backbone embeds every image **once** (eval transform, no
augmentation); the features are normalised — ``"bn"``: standardised with the training
set's per-dimension mean/std, i.e. a BatchNorm without affine parameters in front of the
classifier as in MAE's linear probe; ``"l2"``: unit length, as for kNN; ``"none"`` — and a
linear layer is trained with cross-entropy by Adam (or SGD with momentum) for N epochs with
a cosine learning rate, full-batch or mini-batch. Everything is seeded by `seed` through a
private generator (the global RNG is untouched), so a probe is repeatable. The result is
the top-1 accuracy of the final classifier on the held-out set (no early stopping or
selection on that set).

Why features once and no augmentation: the probe then costs one forward pass over the
data plus a few thousand tiny matrix products, seconds on CPU even for CIFAR-10 with a
ResNet-18, instead of 100 epochs of backbone forwards. It reads lower than the
augmented 100-epoch protocol of the papers; use it to compare runs, not papers.

Example::

    train_f = extract_features(method.embed, train.images, to_eval)
    val_f = extract_features(method.embed, val.images, to_eval)
    result = linear_probe(train_f, train.labels, val_f, val.labels, num_classes=10, epochs=100)
    print(result.top1)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NORMALISATIONS = ("bn", "l2", "none")
OPTIMIZERS = ("adam", "sgd")


@dataclass
class LinearProbeResult:
    top1: float          # held-out accuracy of the final classifier
    train_top1: float    # accuracy on the (frozen) training features
    epochs: int
    steps: int


@torch.no_grad()
def extract_features(encode: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                     transform: Callable[[torch.Tensor], torch.Tensor], batch_size: int = 512) -> torch.Tensor:
    """Raw (unnormalised) float32 features [N, d] of uint8 `images`, computed in batches, on the images' device."""
    feats = [encode(transform(images[i:i + batch_size])).float() for i in range(0, images.shape[0], batch_size)]
    return torch.cat(feats) if feats else torch.empty(0, 0)


def _normalise(train: torch.Tensor, val: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    if how == "l2":
        return F.normalize(train, dim=1), F.normalize(val, dim=1)
    if how == "bn":  # statistics of the training features only; the held-out set never leaks in
        mean, std = train.mean(0, keepdim=True), train.std(0, keepdim=True).clamp_min(1e-6)
        return (train - mean) / std, (val - mean) / std
    return train, val


def linear_probe(train_feats: torch.Tensor, train_labels: torch.Tensor, val_feats: torch.Tensor,
                 val_labels: torch.Tensor, num_classes: int, *, epochs: int = 100, lr: float | None = None,
                 batch_size: int = 256, weight_decay: float = 0.0, optimizer: str = "adam", normalise: str = "bn",
                 seed: int = 0) -> LinearProbeResult:
    """Train a linear classifier on frozen features; return held-out and training top-1.

    `batch_size` 0 means full batch. `lr` defaults to 1e-2 for Adam and 0.5 for SGD (the
    features are normalised, so one default serves every backbone). Runs on the
    features' device in float32.
    """
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise={normalise!r} is unknown; use one of {', '.join(NORMALISATIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use adam or sgd")
    if epochs < 1 or batch_size < 0:
        raise ValueError(f"epochs={epochs} must be >= 1 and batch_size={batch_size} >= 0 (0 = full batch)")
    if train_feats.shape[0] == 0 or val_feats.shape[0] == 0:
        raise ValueError("the linear probe needs at least one training and one held-out sample")
    x, xv = _normalise(train_feats.float(), val_feats.float(), normalise)
    y, yv = train_labels.to(x.device), val_labels.to(x.device)
    n, d = x.shape
    # Zero initialisation: the problem is convex, so nothing is lost and nothing random is drawn.
    linear = torch.nn.utils.skip_init(torch.nn.Linear, d, num_classes, device=x.device)  # no global RNG draw
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.AdamW(linear.parameters(), lr=lr or 1e-2, weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(linear.parameters(), lr=lr or 0.5, momentum=0.9, weight_decay=weight_decay)
    base_lrs = [g["lr"] for g in opt.param_groups]
    bs = n if batch_size == 0 else min(batch_size, n)
    per_epoch = -(-n // bs)
    total = epochs * per_epoch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    threads = torch.get_num_threads()
    if x.device.type == "cpu" and bs * d * num_classes < 2**22:
        # Mini-batch products this small gain nothing from threads, and on a busy machine
        # their synchronisation makes each step several times slower.
        torch.set_num_threads(1)
    try:
        _train(linear, opt, base_lrs, x, y, bs, per_epoch, total, epochs, gen)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        train_top1 = float((linear(x).argmax(1) == y).float().mean())
        top1 = float((linear(xv).argmax(1) == yv).float().mean())
    return LinearProbeResult(top1=top1, train_top1=train_top1, epochs=epochs, steps=total)


def _train(linear: torch.nn.Linear, opt: torch.optim.Optimizer, base_lrs: list[float], x: torch.Tensor,
           y: torch.Tensor, bs: int, per_epoch: int, total: int, epochs: int, gen: torch.Generator) -> None:
    n, step = x.shape[0], 0
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen).to(x.device) if bs < n else None
            for i in range(per_epoch):
                idx = order[i * bs:(i + 1) * bs] if order is not None else slice(None)
                scale = 0.5 * (1 + math.cos(math.pi * step / total))  # cosine to 0
                for g, base in zip(opt.param_groups, base_lrs):
                    g["lr"] = base * scale
                loss = F.cross_entropy(linear(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
