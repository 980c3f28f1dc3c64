"""Shared guard for losses built on batch statistics ([d, d] products, variances) or sharpened softmaxes (MSN).

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


def in_full_precision(loss: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """`loss(*tensors)` with autocast off and half-precision inputs upcast to float32; eager under --compile
    once `keep_losses_eager` has run."""
    return (_EAGER or _full_precision)(loss, *tensors)


_EAGER: Callable[..., torch.Tensor] | None = None


def keep_losses_eager() -> None:
    """Make the float32 losses run eager inside torch.compile'd code (`torch.compiler.disable`). Called by the run
    that compiles, before it compiles: Triton 3.6 (torch 2.11's) can fail to compile NT-Xent's float32
    cross-entropy for a GPU ("PassManager::run failed", make_ttgir), and the loss is a few small kernels on
    [n, d] embeddings: eager, it costs next to nothing. Not at import: making the wrapper imports Dynamo (and FSDP
    with it), which eager runs never need."""
    global _EAGER
    _EAGER = torch.compiler.disable(_full_precision)


def _full_precision(loss: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    tensors = tuple(z.float() if z.dtype in _HALF else z for z in tensors)
    # Meta tensors (FLOP counts) have no autocast to turn off. A plain device test, because torch.compile cannot
    # trace torch.amp.is_autocast_available: it would break the compiled forward in two there.
    if tensors[0].device.type == "meta":
        return loss(*tensors)
    with torch.autocast(tensors[0].device.type, enabled=False):
        return loss(*tensors)
