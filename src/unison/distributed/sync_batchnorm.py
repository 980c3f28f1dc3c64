"""Synchronised batch norm that also works on CPU / gloo, and one converter that picks the right one.

`torch.nn.SyncBatchNorm` raises on CPU tensors (its kernels are CUDA-only), so a CPU or gloo
run needs its own implementation. `GlobalBatchNorm` normalises with the statistics of the
*global* batch:

    per rank r:   n_r, mean_r = mean(x_r), m2_r = sum((x_r - mean_r)^2)        (per channel)
    gathered:     N = sum n_r,  mean = sum n_r mean_r / N,
                  M2 = sum m2_r + sum n_r (mean_r - mean)^2                     (Chan et al.)
    y = (x - mean) / sqrt(M2 / N + eps) * weight + bias
    running_mean <- (1 - m) running_mean + m mean
    running_var  <- (1 - m) running_var  + m M2 / (N - 1)

Per-rank statistics are combined with the weights n_r, so ranks may hold different
numbers of samples. The statistics travel through `all_gather_with_grad`, whose backward
sums every rank's contribution, so autograd yields the exact gradient of the global-batch
loss (tests/test_sync_batchnorm.py checks forward, backward and running statistics
against `nn.BatchNorm2d` on the concatenated batch). One gather of 2C+1 numbers per layer
and forward; the combination is numerically stable (no E[x^2] - E[x]^2 cancellation).

Example::

    model = convert_sync_batchnorm(model, device)   # torch SyncBatchNorm on CUDA, GlobalBatchNorm otherwise
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .collectives import all_gather_with_grad, world_size


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over the global batch of all ranks (any device, any backend)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GlobalBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training or not self.track_running_stats) or world_size() == 1:
            # Evaluation, or a single rank: plain batch norm is exact and faster.
            return super().forward(x)
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        n_local = x.numel() // c
        mean_local = x.mean(dim=dims)
        m2_local = ((x - mean_local.view(1, c, *([1] * (x.dim() - 2)))) ** 2).sum(dim=dims)
        count = torch.full((1,), float(n_local), dtype=x.dtype, device=x.device)
        stats = all_gather_with_grad(torch.cat([count, mean_local, m2_local]).unsqueeze(0))  # [W, 2C+1]
        counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + c], stats[:, 1 + c :]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
        var = m2 / total

        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                unbiased = var * (total / (total - 1)).clamp_min(0) if total > 1 else var
                self.running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased.detach())

        shape = (1, c) + (1,) * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def _convert(module: nn.Module, factory) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, (GlobalBatchNorm, nn.SyncBatchNorm)):
        out = factory(module)
        with torch.no_grad():
            if module.affine:
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, factory))
    return out


def convert_sync_batchnorm(module: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Replace every batch-norm layer by a synchronised one suited to `device`.

    CUDA: `torch.nn.SyncBatchNorm` (fused kernels). Anything else: `GlobalBatchNorm`.
    """
    device = torch.device(device) if device is not None else next(
        (p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)

    def factory(bn: nn.modules.batchnorm._BatchNorm) -> GlobalBatchNorm:
        p = bn.weight if bn.affine else bn.running_mean
        return GlobalBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                               device=p.device if p is not None else None,
                               dtype=p.dtype if p is not None else None)

    return _convert(module, factory)
