"""Named collectives for methods and losses, with exact autograd semantics.

Methods and losses call these functions, never `torch.distributed` directly. Every
function is the identity (or a copy) when no process group is initialised or the
world has one rank, so the same code runs in a single process.

Why hand-written: `torch.distributed.nn.functional.all_gather` has a correct backward
but is deprecated; `torch.distributed._functional_collectives` is private API. The
autograd functions below are small and tested with real processes (tests/distributed/test_collectives.py).

Gradient semantics (the convention every unison loss follows)
-------------------------------------------------------------
Each rank r computes a loss L_r; DDP averages gradients, so training minimises
(1/W) * sum_r L_r. A collective's backward must therefore carry the gradient of
*every* rank's loss back to the rank that owns the input:

* ``all_gather_with_grad(x)``: y = cat(x_0, ..., x_{W-1}) on every rank.
  d(sum_r L_r)/dx_i = sum_r (dL_r/dy)[slice i]  -> all-reduce(SUM) the incoming
  gradient, keep own slice. (Returning only the local gradient slice, the classic
  ``GatherLayer`` bug, drops other ranks' contributions.)
* ``all_reduce_with_grad(x)``: y = sum_i x_i on every rank.
  d(sum_r L_r)/dx_i = sum_r dL_r/dy -> all-reduce(SUM) the incoming gradient.

Example::

    z_all = all_gather_with_grad(z_local)          # [global_batch, dim], differentiable
    c = all_reduce_with_grad(z_a.T @ z_b) / n      # cross-correlation over the global batch
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

# Micro-batches per rank-local batch while an exact accumulation step runs (`micro_batch_layout`), else 1.
_MICRO_BATCHES = 1


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _active() -> bool:
    return is_distributed() and dist.get_world_size() > 1


def _gather_sizes(n: int, device: torch.device) -> list[int]:
    size = torch.tensor([n], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size())]
    dist.all_gather(sizes, size)
    return [int(s.item()) for s in sizes]


def _all_gather_cat(x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """Concatenate x of every rank along dim 0. `sizes` given = ranks may differ in length."""
    x = x.contiguous()
    if sizes is None or len(set(sizes)) == 1:
        parts = [torch.empty_like(x) for _ in range(world_size())]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=0)
    # Uneven first dimensions: pad to the largest, gather, then trim.
    max_n = max(sizes)
    padded = x.new_zeros((max_n, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, uneven: bool) -> torch.Tensor:  # type: ignore[override]
        sizes = _gather_sizes(x.shape[0], x.device) if uneven else [x.shape[0]] * world_size()
        ctx.sizes = sizes
        ctx.rank = rank()
        return _all_gather_cat(x, sizes if uneven else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None


class _AllReduceWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = x.contiguous().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def all_gather_with_grad(x: torch.Tensor, uneven: bool = False) -> torch.Tensor:
    """Concatenate `x` (dim 0) from all ranks; backward sums gradients over ranks.

    Set `uneven=True` when ranks may hold different numbers of rows (one extra
    collective to exchange the sizes).
    """
    if not _active():
        return x
    return _AllGatherWithGrad.apply(x, uneven)


def all_reduce_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over ranks, differentiably: backward all-reduces (sums) the gradient."""
    if not _active():
        return x
    return _AllReduceWithGrad.apply(x)


@torch.no_grad()
def gather_no_grad(x: torch.Tensor, uneven: bool = False) -> torch.Tensor:
    """Concatenate `x` (dim 0) from all ranks, detached (e.g. MoCo keys for the queue)."""
    x = x.detach()
    if not _active():
        return x
    sizes = _gather_sizes(x.shape[0], x.device) if uneven else None
    return _all_gather_cat(x, sizes)


def contiguous_share(n: int, rank: int, world: int) -> slice:
    """Rank `rank`'s part of n items split over `world` ranks: contiguous runs of ceil(n / world), the last
    ones shorter or empty."""
    per = -(-n // world)
    return slice(min(n, rank * per), min(n, (rank + 1) * per))


@contextlib.contextmanager
def micro_batch_layout(k: int) -> Iterator[None]:
    """While exact gradient accumulation runs one forward on a step's K micro-batches, each rank's batch is its
    slices of K global micro-batches (micro-major); `micro_major` then puts a gather back in the global order."""
    global _MICRO_BATCHES
    previous, _MICRO_BATCHES = _MICRO_BATCHES, k
    try:
        yield
    finally:
        _MICRO_BATCHES = previous


def micro_major(x: torch.Tensor) -> torch.Tensor:
    """Rows of an even gather (rank-major: rank r's K micro-batch slices) in the global sample order
    (micro-batch-major: micro-batch k's slices of every rank), the order of one process on the same samples.
    Where a gather's order is kept in state (MoCo's and SwAV's queues) this keeps it world-size invariant."""
    w, k = world_size(), _MICRO_BATCHES
    if w == 1 or k == 1:
        return x
    return x.reshape(w, k, x.shape[0] // (w * k), *x.shape[1:]).transpose(0, 1).reshape(x.shape)


@torch.no_grad()
def all_reduce_no_grad(x: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (or average) `x` over ranks without autograd; returns a new tensor."""
    y = x.detach().clone()
    if _active():
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        if average:
            y /= world_size()
    return y


def all_reduce_max_no_grad(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of `x` over ranks without autograd; returns a new tensor (CAPI's Sinkhorn-Knopp
    shifts its exponent by the global batch's maximum, so every rank exponentiates on one scale)."""
    y = x.detach().clone()
    if _active():
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return y


@torch.no_grad()
def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` in place with rank `src`'s value."""
    if _active():
        dist.broadcast(x, src=src)
    return x


def broadcast_object(obj, src: int = 0):
    """Return rank `src`'s picklable Python object on every rank (small metadata only)."""
    if not _active():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj) -> list:
    """Every rank's picklable Python object, in rank order (small metadata only)."""
    if not _active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_object_to_rank0(obj) -> list | None:
    """Every rank's picklable object, in rank order, on rank 0 (None elsewhere). Tensors should be on the CPU."""
    if not _active():
        return [obj]
    out: list | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    if _active():
        dist.barrier()


def local_slice(global_count: int) -> slice:
    """This rank's contiguous share of `global_count` rows (equal shares, in rank order)."""
    w, r = world_size(), rank()
    if global_count % w:
        raise ValueError(f"{global_count} rows cannot be split evenly over {w} ranks")
    n = global_count // w
    return slice(r * n, (r + 1) * n)
