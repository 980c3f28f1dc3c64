"""Exact gradient accumulation: the gradient of one step on all K micro-batches, at the memory of one.

GradCache (Gao et al., 2021) applied at the backbone, for every method at once. A step's K micro-batches are
concatenated (per view, micro-batch-major) and the method runs ONE forward on them, in which every backbone
call (``forward`` and a ViT's ``forward_tokens``, of the online backbone and of momentum/teacher copies) is
intercepted:

1. pass 1: each call is computed micro-batch by micro-batch without a graph (the CPU/CUDA generator state
   saved before each), and its output returned as a leaf tensor; the rest of the method (heads, gathers over
   ranks, the loss, queue/centre updates, Sinkhorn) runs once on the whole step's embeddings, as one big
   batch would; ``backward`` gives the parameters outside the backbone their gradients and the leaves theirs;
2. pass 2: the backbone's running statistics are put back as they were before pass 1, then each micro-batch of
   each call is re-run with its graph, its generator state restored (dropout, drop-path replay identically),
   and back-propagated with its slice of the cached output gradient (`torch.autograd.backward`).

Each backbone call's micro-batch k is the rows of micro-batch k in every view the call concatenates, so a
backbone with batch norm normalises exactly what plain accumulation's micro-batch k would (SyncBN: over every
rank); heads see the whole step. Backbone activations are held for one micro-batch at a time; the cost is
one extra backbone forward (without graph) per step. All passes run under DDP's ``no_sync``; the gradients
are then averaged over ranks in one flat all-reduce per dtype (DDP's semantics).

Example::

    with ExactAccumulation(method, micro_batches=K, rows=b) as acc:   # b: this rank's micro-batch size
        loss = ddp_model(views_of_all_K)          # pass 1
        loss.backward()
        acc.replay()                              # pass 2
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from unison.distributed import collectives as C

# Backbone entry points intercepted: the pooled feature, and a ViT's tokens (iBOT, I-JEPA call it directly).
_ENTRY_POINTS = ("forward", "forward_tokens")


def backbones(method: nn.Module) -> list[nn.Module]:
    """Every backbone of `method`: the online one and momentum/teacher copies (``*.backbone``), once each."""
    seen: dict[int, nn.Module] = {}
    for name, module in method.named_modules():
        if name == "backbone" or name.endswith(".backbone"):
            seen.setdefault(id(module), module)
    return list(seen.values())


def micro_rows(n: int, micro_batches: int, rows: int, device: torch.device) -> list[torch.Tensor]:
    """For an input of n = views x K x rows samples (views concatenated, each micro-batch-major): the row
    indices of each micro-batch, across every view."""
    if n % (micro_batches * rows):
        raise RuntimeError(f"exact accumulation: a backbone input of {n} samples is not views x {micro_batches} "
                           f"micro-batches x {rows} rows")
    views, base = n // (micro_batches * rows), torch.arange(rows, device=device)
    return [torch.cat([v * micro_batches * rows + k * rows + base for v in range(views)])
            for k in range(micro_batches)]


@dataclass
class _Call:
    """One intercepted backbone call of pass 1 with a graph: what pass 2 needs to replay it."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    kwargs: dict[str, Any]
    rows: list[torch.Tensor]
    rng: list[tuple[torch.Tensor, list[torch.Tensor]]]
    out: torch.Tensor


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def _take(x: Any, n: int, rows: torch.Tensor) -> Any:
    """`x`'s rows `rows` if it is a per-sample tensor of the call (dim 0 of size n), else `x` itself."""
    return x.index_select(0, rows) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n else x


@dataclass
class ExactAccumulation:
    """Intercepts `method`'s backbones for one exact accumulation step (module docstring)."""

    method: nn.Module
    micro_batches: int
    rows: int                                   # this rank's samples per micro-batch
    calls: list[_Call] = field(default_factory=list)
    _inside: bool = False                       # within an intercepted call: nested entry points run as they are
    _saved: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _patched: list[tuple[nn.Module, str]] = field(default_factory=list)

    def __enter__(self) -> ExactAccumulation:
        for module in backbones(self.method):
            if any(p.requires_grad for p in module.parameters()):   # pass 2 recomputes these: keep their stats
                self._saved += [(b, b.detach().clone()) for b in module.buffers()]
            for entry in _ENTRY_POINTS:
                fn = getattr(module, entry, None)
                if callable(fn) and entry not in module.__dict__:
                    setattr(module, entry, self._intercept(fn))
                    self._patched.append((module, entry))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, entry in self._patched:
            delattr(module, entry)
        self._patched.clear()

    def _intercept(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            try:
                return self._pass1(fn, args, kwargs)
            finally:
                self._inside = False
        return call

    def _pass1(self, fn: Callable[..., torch.Tensor], args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        n = args[0].shape[0]
        rows = micro_rows(n, self.micro_batches, self.rows, args[0].device)
        graph = torch.is_grad_enabled()
        rng, out = [], None
        for r in rows:
            rng.append(_rng_state())
            with torch.no_grad():
                y = fn(*(_take(a, n, r) for a in args), **{k: _take(v, n, r) for k, v in kwargs.items()})
            if out is None:
                out = y.new_empty((n, *y.shape[1:]))
            out[r] = y
        assert out is not None
        owner = getattr(fn, "__self__", None)
        trained = any(p.requires_grad for p in owner.parameters()) if isinstance(owner, nn.Module) else True
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if graph and (trained or any(t.requires_grad for t in inputs)):
            out.requires_grad_(True)
            self.calls.append(_Call(fn, args, kwargs, rows, rng, out))
        return out

    def replay(self) -> None:
        """Pass 2: each recorded call again, micro-batch by micro-batch with its graph, back-propagating the
        gradient pass 1's backward left on its output (after the running statistics are put back)."""
        with torch.no_grad():
            for buffer, saved in self._saved:
                buffer.copy_(saved)
        after = _rng_state()
        self._inside = True
        try:
            for c in self.calls:
                if c.out.grad is None:      # the output did not reach the loss
                    continue
                n = c.out.shape[0]
                for r, state in zip(c.rows, c.rng):
                    _set_rng_state(state)
                    y = c.fn(*(_take(a, n, r) for a in c.args), **{k: _take(v, n, r) for k, v in c.kwargs.items()})
                    torch.autograd.backward(y, c.out.grad.index_select(0, r))
        finally:
            self._inside = False
            self.calls.clear()
            _set_rng_state(after)


def average_gradients(params: list[nn.Parameter]) -> None:
    """DDP's gradient average over ranks, once, for gradients accumulated under ``no_sync``: one flat all-reduce
    per dtype. Every rank ran the same computation, so the same parameters have gradients on every rank."""
    if C.world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = C.all_reduce_no_grad(torch.cat([g.reshape(-1) for g in grads]), average=True)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (gradients stay local until `average_gradients`); a no-op for an unwrapped model."""
    sync = getattr(model, "no_sync", None)
    return sync() if callable(sync) else contextlib.nullcontext()
