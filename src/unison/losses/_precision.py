"""Shared guard for losses built on batch statistics ([d, d] products, variances).

Those lose too much in half precision, so under AMP such a loss runs in float32: autocast
off, float16/bfloat16 inputs upcast, float32/float64 inputs kept as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_HALF = (torch.float16, torch.bfloat16)


def check_embedding_pair(z_a: torch.Tensor, z_b: torch.Tensor) -> None:
    if z_a.shape != z_b.shape or z_a.dim() != 2:
        raise ValueError(f"expected two [n, d] embeddings of one shape, got {tuple(z_a.shape)} and {tuple(z_b.shape)}")


# Eager under --compile: the loss is a few small kernels on [n, d] embeddings, and on an H100 (torch 2.11, Triton
# 3.6) Triton failed to compile NT-Xent's float32 cross-entropy ("PassManager::run failed", make_ttgir).
@torch.compiler.disable
def in_full_precision(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                      z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
    """`loss(z_a, z_b)` with autocast off and half-precision inputs upcast to float32."""
    z_a, z_b = (z.float() if z.dtype in _HALF else z for z in (z_a, z_b))
    # Meta tensors (FLOP counts) have no autocast to turn off. A plain device test, because torch.compile cannot
    # trace torch.amp.is_autocast_available: it broke the compiled forward in two there.
    if z_a.device.type == "meta":
        return loss(z_a, z_b)
    with torch.autocast(z_a.device.type, enabled=False):
        return loss(z_a, z_b)
