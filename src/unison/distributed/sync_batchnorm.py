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
numbers of samples; the combination is numerically stable (no E[x^2] - E[x]^2
cancellation). The backward is the exact gradient of the global-batch loss, in the
convention of `unison.distributed.collectives` (dy_r = d(sum_s L_s)/dy_r on rank r):

    xhat = (x - mean) * invstd,   invstd = 1 / sqrt(var + eps)
    g1 = sum over ALL ranks of dy,   g2 = sum over ALL ranks of dy * xhat     (one all-reduce of 2C)
    dx_r = weight * invstd * (dy_r - g1 / N - xhat_r * g2 / N)
    dweight_r = sum_r(dy_r * xhat_r),  dbias_r = sum_r(dy_r)   (local; DDP averages them)

Why a hand-written autograd function: expressing the normalisation with elementwise
tensor ops lets autograd derive this backward, but costs about ten passes over every
activation in forward and backward, where one worker's plain batch norm makes one fused
pass. Here every pass over the activation is a fused
ATen CPU kernel: `batch_norm_update_stats` (local mean and variance), `batch_norm` in
inference form with the global statistics (the output), `native_batch_norm_backward`
(the two local reductions), and two `addcmul` for dx. Collectives per layer and step:
one gather of 2C+1 numbers in forward, one all-reduce of 2C numbers in backward.
tests/distributed/test_sync_batchnorm.py checks output, dx, dweight, dbias and running statistics
against `nn.BatchNorm1d/2d` on the concatenated batch, with uneven ranks.

Example::

    model = convert_sync_batchnorm(model, device)   # torch SyncBatchNorm on CUDA, GlobalBatchNorm otherwise
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .collectives import all_reduce_no_grad, gather_no_grad, world_size


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
        out_dtype = x.dtype
        if x.dtype in (torch.float16, torch.bfloat16):  # statistics and normalisation in float32
            x = x.float()
        mean, var, total = _global_statistics(x)

        if self.training and self.track_running_stats:
            running_mean, running_var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
            # _BatchNorm registers all three buffers whenever track_running_stats is True.
            assert running_mean is not None and running_var is not None and tracked is not None
            with torch.no_grad():
                tracked.add_(1)
                momentum = 1.0 / tracked if self.momentum is None else self.momentum   # None: cumulative average
                unbiased = var * (total / (total - 1).clamp_min(1))   # N = 1 keeps the biased one
                running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))

        weight = self.weight.to(x.dtype) if self.affine else None
        bias = self.bias.to(x.dtype) if self.affine else None
        y = _GlobalBatchNormFunction.apply(x, weight, bias, mean, var, total, self.eps)
        return y.to(out_dtype)


@torch.no_grad()
def _global_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel over the global batch (Chan's combination), and N, all tensors: no
    host read inside the step, and nothing that breaks a torch.compile graph. N is never 0: every rank trains on
    at least one image (the configuration refuses smaller batches)."""
    c = x.shape[1]
    n_local = x.numel() // c
    if n_local > 0:
        mean_local, var_local = torch.batch_norm_update_stats(x, None, None, 0.0)  # one fused pass
    else:  # this rank holds no rows: it contributes nothing
        mean_local = var_local = x.new_zeros(c)
    count = x.new_full((1,), float(n_local))
    stats = gather_no_grad(torch.cat([count, mean_local, var_local * n_local]).unsqueeze(0))  # [W, 2C+1]
    counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + c], stats[:, 1 + c :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class _GlobalBatchNormFunction(torch.autograd.Function):
    """y = batch norm of x with the given global statistics; backward: the formula in the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, total, eps):  # type: ignore[override]
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight if weight is not None else torch.ones_like(mean)
        # Local sums over this rank's rows: sum(dy * xhat) and sum(dy), in one fused pass.
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, w, None, None, mean, invstd, True, 0.0, [False, True, True])
        dx = None
        if need_x:
            c = mean.numel()
            global_sums = all_reduce_no_grad(torch.cat([sum_dy, sum_dy_xhat]))
            g_dy, g_dy_xhat = global_sums[:c] / ctx.total, global_sums[c:] / ctx.total
            a = w * invstd                      # dx = a * dy + k * x + b, per channel
            k = -a * invstd * g_dy_xhat
            b = -a * g_dy - k * mean
            shape = (1, c) + (1,) * (x.dim() - 2)
            dx = torch.addcmul(b.view(shape), x, k.view(shape)).addcmul_(dy, a.view(shape))
        return (dx, sum_dy_xhat if need_w and weight is not None else None,
                sum_dy if need_b and weight is not None else None, None, None, None, None)


class RunningStatistics:
    """Mixin of a batch norm frozen by ``--freeze``: always in eval mode, so it normalises with its running
    statistics and never updates them (``model.train()`` included), as mmdetection's ``norm_eval`` and detectron2's
    ``FrozenBatchNorm2d`` keep a pretrained network's frozen stages. It needs nothing from other ranks, so the
    conversions below leave it as it is. `hold_running_statistics` turns a batch norm into one."""

    def train(self, mode: bool = True):
        return super().train(False)  # type: ignore[misc]


_HELD: dict[type, type] = {}


def hold_running_statistics(bn: nn.modules.batchnorm._BatchNorm) -> None:
    """Make `bn` a `RunningStatistics` batch norm of its own class (its state dict and ``isinstance`` unchanged)."""
    cls = type(bn)
    if not issubclass(cls, RunningStatistics):
        if cls not in _HELD:   # one class per batch-norm class
            _HELD[cls] = type(f"Frozen{cls.__name__}", (RunningStatistics, cls), {})
        bn.__class__ = _HELD[cls]
    bn.train(False)


def _convert(module: nn.Module, factory) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
            module, (GlobalBatchNorm, nn.SyncBatchNorm, RunningStatistics)):
        out = factory(module)
        with torch.no_grad():
            if module.affine:   # frozen stays frozen (a momentum encoder's, --freeze's), as torch's CUDA conversion keeps it
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
                out.weight.requires_grad_(module.weight.requires_grad)
                out.bias.requires_grad_(module.bias.requires_grad)
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

    CUDA: `torch.nn.SyncBatchNorm` (fused kernels). Anything else: `GlobalBatchNorm`. Both through `_convert`
    (torch's own converter would also convert the `RunningStatistics` batch norms of ``--freeze``).
    """
    device = torch.device(device) if device is not None else next(
        (p.device for p in module.parameters()), torch.device("cpu"))
    kind = nn.SyncBatchNorm if device.type == "cuda" else GlobalBatchNorm

    def factory(bn: nn.modules.batchnorm._BatchNorm) -> nn.modules.batchnorm._BatchNorm:
        p = bn.weight if bn.affine else bn.running_mean
        return kind(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                    device=p.device if p is not None else None, dtype=p.dtype if p is not None else None)

    return _convert(module, factory)
