"""Optimizers for data-parallel training: gradient averaging, ZeRO-1 sharding, local SGD, LARS.

Which one to use
----------------
* Model wrapped in DDP: DDP already averages the gradients; use a plain optimizer
  (``build_optimizer``), or ``ShardedOptimizer`` to shard the optimizer state.
* Model NOT wrapped in DDP (e.g. a loss with its own collectives, or no module hooks
  wanted): ``GradientAveragingOptimizer(opt)``. ``step()`` all-reduces every
  gradient, divides by the world size, then steps ``opt``. With each rank's loss the
  mean over its local rows (equal local batch sizes), this is exactly one optimizer
  stepping on the gradient of the global-batch mean loss.
* ``ShardedOptimizer(params, torch.optim.AdamW, lr=...)``: ZeRO-1 on top of
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` (works on gloo): each rank keeps
  optimizer state only for the parameters it owns, steps those, and broadcasts them.
  Pass ``average_gradients=True`` when the model is not in DDP.
* ``LocalSGD(opt, period=K)``: each rank steps on its *local* gradients and the
  parameters are averaged every K steps. Less communication, but NOT equivalent to
  large-batch training, and momentum / Adam state stay local (never averaged).
* ``LARS``: layer-wise adaptive rate scaling as in the SimCLR / BYOL / Barlow Twins
  recipes; a plain ``torch.optim.Optimizer``, so every wrapper above accepts it.

All wrappers subclass ``torch.optim.Optimizer`` (so LR schedulers accept them), proxy
``param_groups`` / ``state`` / ``zero_grad`` to the wrapped optimizer, expose ``rank``,
``world_size`` and ``optimizer`` (the wrapped one), and work at world size 1 without a
process group (then they never communicate). The world size is read at construction:
create them after joining the process group. ``step()`` and
``synchronize_optimizer_state()`` are collectives: call them on every rank.

Example::

    model = Net()                                              # identical init on every rank
    opt = GradientAveragingOptimizer(build_optimizer("lars", model.parameters(),
                                                     lr=0.3, weight_decay=1e-6))
    for x in loader:                                           # different data per rank
        opt.zero_grad()
        loss_fn(model(x)).backward()                           # mean over local rows
        opt.step()                                             # = step on the global batch
    torch.save(opt.state_dict(), "opt.pt")                     # same on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim import Optimizer

__all__ = ["GradientAveragingOptimizer", "LARS", "LocalSGD", "OPTIMIZER_NAMES", "ShardedOptimizer",
           "build_optimizer"]

OPTIMIZER_NAMES = ("sgd", "lars", "adam", "adamw")

# Largest flat buffer one all-reduce uses (elements): bounds the extra memory of
# coalescing to ~64 MiB of fp32 while keeping the number of collectives small.
_BUCKET_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------- helpers
def _group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _group_active() else (0, 1)


def _comm_device() -> torch.device:
    """Device for tensors we create only to communicate (NCCL cannot move CPU tensors)."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _zero_class() -> type | None:
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # torch built without distributed support
        return None
    return ZeroRedundancyOptimizer


def _params_of(groups: Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for group in groups for p in group["params"]]


def _check_trainable(params: list[torch.Tensor], who: str) -> None:
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{who} got no parameter with requires_grad=True; pass the trainable parameters "
                         "(e.g. model.parameters() after unfreezing)")


def _check_not_lbfgs(cls: type, who: str) -> None:
    if issubclass(cls, torch.optim.LBFGS):
        raise TypeError(f"{who} cannot use LBFGS: its closure re-evaluates the loss during a line search, which "
                        "is not gradient averaging; wrap the model in DistributedDataParallel and use LBFGS directly")


def _check_wrappable(optimizer: Any, who: str) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{who} wraps a torch.optim.Optimizer but got {type(optimizer).__name__}; build one first, "
                        "e.g. build_optimizer('sgd', model.parameters(), lr=0.1, weight_decay=0.0)")
    if isinstance(optimizer, _DistributedOptimizer):
        raise TypeError(f"{who} got a {type(optimizer).__name__}, which already communicates; "
                        "wrap the plain optimizer once")
    zero = _zero_class()
    if zero is not None and isinstance(optimizer, zero):
        raise TypeError(f"{who} cannot wrap a ZeroRedundancyOptimizer; use ShardedOptimizer(params, "
                        "optimizer_class, average_gradients=True) instead")
    _check_not_lbfgs(type(optimizer), who)
    _check_trainable(_params_of(optimizer.param_groups), who)


def _chunks(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Split same-dtype/device tensors into runs of at most _BUCKET_ELEMENTS elements."""
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if run and size + t.numel() > _BUCKET_ELEMENTS:
            yield run
            run, size = [], 0
        run.append(t)
        size += t.numel()
    if run:
        yield run


def _by_dtype_and_device(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        yield from _chunks(bucket)


@torch.no_grad()
def _average_gradients(params: list[torch.Tensor], world_size: int) -> None:
    """Replace every ``p.grad`` by its mean over ranks (coalesced all-reduce per dtype/device).

    ``params`` must be the same list, in the same order, on every rank. A missing grad
    counts as zeros so that ranks never disagree on what is communicated (a rank with
    ``None`` would otherwise skip a collective and deadlock the others). A presence mask
    travels in the same buffer: a parameter whose grad is ``None`` on *every* rank keeps
    ``None``, so the optimizer skips it as it would in a single process (zeros would
    still apply weight decay and momentum to it).
    """
    if world_size == 1:
        return
    for bucket in _by_dtype_and_device(params):
        present = [p.grad is not None for p in bucket]
        grads = []
        for p in bucket:
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError("gradient averaging does not support sparse gradients; wrap the model in "
                                "DistributedDataParallel instead")
            grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
        mask = torch.tensor(present, dtype=bucket[0].dtype, device=bucket[0].device)
        flat = _flatten_dense_tensors(grads + [mask])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # gloo has no ReduceOp.AVG
        flat.div_(world_size)
        n = len(bucket)
        anywhere = None if all(present) else (flat[-n:] > 0).tolist()  # host sync only when needed
        for i, (p, avg) in enumerate(zip(bucket, _unflatten_dense_tensors(flat[:-n], bucket))):
            if present[i]:
                p.grad.copy_(avg)
            elif anywhere is not None and anywhere[i]:
                p.grad = torch.empty_like(p).copy_(avg)  # empty_like keeps the parameter's memory format


@torch.no_grad()
def _average_parameters(params: list[torch.Tensor], world_size: int) -> None:
    if world_size == 1:
        return
    for bucket in _by_dtype_and_device(params):
        flat = _flatten_dense_tensors([p.detach() for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        for p, avg in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            p.copy_(avg)


@dataclass(frozen=True)
class _TensorSlot:
    """Placeholder for a tensor in a broadcast state-dict skeleton."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cuda: bool


def _strip_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
        return _TensorSlot(tuple(obj.shape), obj.dtype, obj.is_cuda)
    if isinstance(obj, dict):
        return {k: _strip_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_strip_tensors(v, out) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _collect_slots(obj: Any, out: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)


def _fill_tensors(obj: Any, tensors: Iterable[torch.Tensor]) -> Any:
    it = iter(tensors)

    def fill(o: Any) -> Any:
        if isinstance(o, _TensorSlot):
            return next(it)
        if isinstance(o, dict):
            return {k: fill(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            items = [fill(v) for v in o]
            return items if isinstance(o, list) else tuple(items)
        return o

    return fill(obj)


@torch.no_grad()
def _broadcast_state_dict(state_dict: dict[str, Any] | None, src: int = 0) -> dict[str, Any]:
    """Rank `src`'s state dict on every rank: structure as one object, tensors coalesced per dtype.

    Pickling tensors inside ``broadcast_object_list`` would copy them twice more and,
    under NCCL, go through host memory; only the small skeleton is pickled here.
    """
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(state_dict, tensors) if rank == src else None
    holder = [skeleton]
    dist.broadcast_object_list(holder, src=src)
    skeleton = holder[0]
    slots: list[_TensorSlot] = []
    _collect_slots(skeleton, slots)
    comm = _comm_device()
    if rank != src:
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=comm) for s in slots]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, s in enumerate(slots):
        by_dtype.setdefault(s.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = _flatten_dense_tensors([tensors[i].to(comm) for i in indices])
        dist.broadcast(flat, src=src)
        if rank != src:
            for i, t in zip(indices, _unflatten_dense_tensors(flat, [tensors[i] for i in indices])):
                device = torch.device("cuda", torch.cuda.current_device()) if slots[i].on_cuda else torch.device("cpu")
                tensors[i] = t.to(device).clone()  # own storage, not a view of the flat buffer
    if rank == src:
        assert state_dict is not None
        return state_dict
    return _fill_tensors(skeleton, tensors)


def _state_bytes(*states: dict[Any, Any]) -> int:
    seen: set[tuple[str, int]] = set()
    total = 0
    for state in states:
        for per_param in state.values():
            if not isinstance(per_param, dict):
                continue  # ZeroRedundancyOptimizer stores None for parameters other ranks own
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    key = (str(v.device), v.untyped_storage().data_ptr())
                    if key not in seen:  # count aliased tensors once
                        seen.add(key)
                        total += v.numel() * v.element_size()
    return total


def _evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# ------------------------------------------------------------------------- wrappers
class _DistributedOptimizer(Optimizer):
    """Common proxying for the wrappers; ``Optimizer.__init__`` is deliberately not called.

    Subclassing ``Optimizer`` makes LR schedulers (which check ``isinstance``) accept the
    wrapper; the state itself lives in the wrapped optimizer only.
    """

    _optimizer: Optimizer
    _rank: int
    _world_size: int

    @property
    def optimizer(self) -> Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        # A property, not a shared list: Optimizer.load_state_dict replaces the list object.
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    def _trainable_params(self) -> list[torch.Tensor]:
        return [p for p in _params_of(self.param_groups) if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; do it on every rank, in the same order."""
        self._optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def local_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held by this rank."""
        return _state_bytes(self._optimizer.state)

    def synchronize_optimizer_state(self) -> None:
        """Give every rank rank 0's optimizer state (buffers, step counters, hyperparameters). Collective."""
        if self._world_size == 1:
            return
        full = _broadcast_state_dict(self._optimizer.state_dict() if self._rank == 0 else None, src=0)
        if self._rank != 0:
            self._optimizer.load_state_dict(full)

    def __getstate__(self) -> dict[str, Any]:  # Optimizer's version assumes its own attributes
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, world_size={self._world_size}, {self._optimizer!r})"


class GradientAveragingOptimizer(_DistributedOptimizer):
    """Average gradients over ranks, then step the wrapped optimizer (for models NOT in DDP).

    Equivalent to one process stepping on the gradient of the global-batch mean loss when
    every rank's loss is the mean over its (equally sized) local batch. Only parameters
    with ``requires_grad=True`` are averaged; they must be the same on every rank. A
    gradient that is ``None`` on some ranks counts as zeros there; ``None`` on all ranks
    stays ``None``. The optimizer state stays identical on all ranks because every rank
    applies the same update; ``synchronize_optimizer_state()`` repairs it if it diverged
    (e.g. after loading a per-rank checkpoint). Do not combine with DDP (gradients would
    be averaged twice: harmless but wasted communication).

    Gradient clipping must see the averaged gradient to match single-process training:
    ``opt.average_gradients(); clip_grad_norm_(...); opt.step()`` (``step()`` averages
    again: identical gradients stay unchanged up to rounding, for one more all-reduce).
    """

    def __init__(self, optimizer: Optimizer) -> None:
        _check_wrappable(optimizer, "GradientAveragingOptimizer")
        self._optimizer = optimizer
        self._rank, self._world_size = _rank_and_world_size()

    def average_gradients(self) -> None:
        """All-reduce-average the gradients now (``step()`` does this itself). Collective."""
        _average_gradients(self._trainable_params(), self._world_size)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        # The closure (if any) runs first so its gradients are the ones averaged.
        loss = _evaluate_closure(closure)
        self.average_gradients()
        self._optimizer.step()
        return loss


class ShardedOptimizer(_DistributedOptimizer):
    """ZeRO-1: each rank keeps optimizer state only for the parameters it owns.

    Built on ``torch.distributed.optim.ZeroRedundancyOptimizer``: parameters are assigned
    whole to ranks (largest first, to the least loaded rank); ``step()`` updates the
    owned parameters and broadcasts them so every replica stays identical. With
    ``average_gradients=True`` (model not in DDP) gradients are all-reduce-averaged over
    all parameters first, as in ``GradientAveragingOptimizer``. Without a process group
    (one process) it is a plain ``optimizer_class`` with the same API.

    Checkpoints: ``state_dict()`` is a collective (consolidates on rank 0, then gives the
    full state to every rank); the result has the format of an unsharded
    ``optimizer_class`` state dict, so it loads into a ``ShardedOptimizer`` at any world
    size or into a plain optimizer. Like ``torch.optim.Optimizer.state_dict``, it may
    reference live state tensors: save it (or ``copy.deepcopy`` it) before the next step.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], *,
                 average_gradients: bool = False, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"ShardedOptimizer needs an optimizer class such as torch.optim.AdamW, got "
                            f"{optimizer_class!r}")
        if issubclass(optimizer_class, _DistributedOptimizer):
            raise TypeError(f"ShardedOptimizer cannot shard {optimizer_class.__name__}; pass the plain optimizer "
                            "class and average_gradients=True")
        _check_not_lbfgs(optimizer_class, "ShardedOptimizer")
        params = list(params)
        flat = _params_of(params) if params and isinstance(params[0], dict) else params
        _check_trainable(flat, "ShardedOptimizer")
        self._average = bool(average_gradients)
        self._sharded = _group_active()
        if self._sharded:
            zero = _zero_class()
            assert zero is not None  # a process group exists, so torch.distributed is built
            self._optimizer = zero(params, optimizer_class=optimizer_class, **defaults)
            self._rank, self._world_size = self._optimizer.rank, self._optimizer.world_size
        else:
            self._optimizer = optimizer_class(params, **defaults)
            self._rank, self._world_size = 0, 1

    @property
    def sharding(self) -> dict[str, Any]:
        """Which parameters (indices into the flattened param groups) each rank owns.

        ``{"world_size": W, "owner": [rank of parameter i], "params_per_rank": [[i, ...], ...],
        "numel_per_rank": [elements owned by each rank]}``.
        """
        params = _params_of(self.param_groups)
        if self._sharded:
            to_rank = self._optimizer._param_to_rank  # private but stable since torch 1.8; no public query
            owner = [to_rank[p] for p in params]
        else:
            owner = [0] * len(params)
        per_rank = [[i for i, o in enumerate(owner) if o == r] for r in range(self._world_size)]
        return {"world_size": self._world_size, "owner": owner, "params_per_rank": per_rank,
                "numel_per_rank": [sum(params[i].numel() for i in idx) for idx in per_rank]}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = _evaluate_closure(closure)
        if self._average:
            _average_gradients(self._trainable_params(), self._world_size)
        self._optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The full (consolidated) optimizer state, on every rank. Collective: call on all ranks."""
        if not self._sharded:
            return self._optimizer.state_dict()
        self._optimizer.consolidate_state_dict(to=0)
        full = self._optimizer.state_dict() if self._rank == 0 else None
        return _broadcast_state_dict(full, src=0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` at any world size); keep only the local shard."""
        if not self._sharded:
            self._optimizer.load_state_dict(state_dict)
            return
        # ZeroRedundancyOptimizer overwrites other ranks' entries of the dict it is given.
        self._optimizer.load_state_dict({**state_dict, "state": dict(state_dict["state"])})
        # Its base class also keeps a second copy of the local shard in its own `state`,
        # which nothing reads (the local optimizer has the live one): drop it.
        self._optimizer.state.clear()

    def local_state_bytes(self) -> int:
        if not self._sharded:
            return _state_bytes(self._optimizer.state)
        return _state_bytes(self._optimizer.optim.state, self._optimizer.state)

    def synchronize_optimizer_state(self) -> None:
        """Give every rank rank 0's hyperparameters (lr, weight decay, ...). Collective.

        The state of each parameter lives on exactly one rank (its owner), so there is no
        second copy that could disagree and the shards are left as they are. To get the
        full state on every rank, call ``state_dict()``.
        """
        if self._world_size == 1:
            return
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        holder = [hyper]
        dist.broadcast_object_list(holder, src=0)
        for group, local in zip(self.param_groups, holder[0]):
            group.update(local)  # the local optimizer picks these up at the next step


class LocalSGD(_DistributedOptimizer):
    """Local SGD (post-local SGD): step on local gradients, average parameters every `period` steps.

    For models NOT in DDP. During the first `warmup_steps` steps gradients are averaged
    every step (as ``GradientAveragingOptimizer``); afterwards each rank steps on its own
    gradients and after every `period`-th local step the parameters (those requiring
    grad; not buffers such as batch-norm statistics) are averaged over ranks. Cuts
    communication by ~`period`x, but it is NOT equivalent to large-batch training:
    between averages the replicas drift on different data. Momentum / Adam state are
    never averaged and stay local (call ``synchronize_optimizer_state()`` to copy rank
    0's). ``state_dict()`` adds ``"local_sgd_step"`` so a resumed run keeps its phase.
    """

    def __init__(self, optimizer: Optimizer, period: int, warmup_steps: int = 0) -> None:
        _check_wrappable(optimizer, "LocalSGD")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"LocalSGD period={period!r} must be an integer >= 1 (steps between parameter averages)")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LocalSGD warmup_steps={warmup_steps!r} must be an integer >= 0")
        self._optimizer = optimizer
        self._period = period
        self._warmup_steps = warmup_steps
        self._local_steps = 0
        self._rank, self._world_size = _rank_and_world_size()

    @property
    def period(self) -> int:
        return self._period

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def step_count(self) -> int:
        """Steps taken so far (warm-up included)."""
        return self._local_steps

    def average_parameters(self) -> None:
        """Average the trainable parameters over ranks now (e.g. before evaluation). Collective."""
        _average_parameters(self._trainable_params(), self._world_size)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = _evaluate_closure(closure)
        if self._local_steps < self._warmup_steps:
            _average_gradients(self._trainable_params(), self._world_size)
            self._optimizer.step()
        else:
            self._optimizer.step()
            if (self._local_steps + 1 - self._warmup_steps) % self._period == 0:
                self.average_parameters()
        self._local_steps += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {**self._optimizer.state_dict(), "local_sgd_step": self._local_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self._local_steps = int(state_dict.pop("local_sgd_step", 0))
        self._optimizer.load_state_dict(state_dict)


# ----------------------------------------------------------------------------- LARS
class LARS(Optimizer):
    """LARS as in the SimCLR / BYOL / Barlow Twins recipes.

    For each parameter p with gradient g, when adaptation applies (always, or only for
    ``p.ndim > 1`` with ``exclude_bias_and_norm=True``)::

        g = g + weight_decay * p
        trust = eta * ||p|| / ||g||   if ||p|| > 0 and ||g|| > 0   else 1
        update = trust * g

    otherwise ``update = g`` (biases and norm weights get neither weight decay nor
    adaptation). Then ``mu = momentum * mu + update`` and ``p -= lr * mu``.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9, weight_decay: float = 1e-6,
                 eta: float = 0.001, exclude_bias_and_norm: bool = True) -> None:
        if not lr >= 0:
            raise ValueError(f"LARS lr={lr!r} must be >= 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"LARS momentum={momentum!r} must be in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"LARS weight_decay={weight_decay!r} must be >= 0")
        if not eta > 0:
            raise ValueError(f"LARS eta={eta!r} (trust coefficient) must be > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      exclude_bias_and_norm=exclude_bias_and_norm))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = _evaluate_closure(closure)
        for group in self.param_groups:
            lr, momentum, wd, eta = group["lr"], group["momentum"], group["weight_decay"], group["eta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("LARS does not support sparse gradients")
                update = p.grad
                if not (group["exclude_bias_and_norm"] and p.ndim <= 1):
                    update = update.add(p, alpha=wd)
                    p_norm = torch.linalg.vector_norm(p)
                    u_norm = torch.linalg.vector_norm(update)
                    # torch.where instead of `if`: no host sync on accelerators.
                    trust = torch.where((p_norm > 0) & (u_norm > 0), eta * p_norm / u_norm,
                                        torch.ones_like(p_norm))
                    update = update * trust
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = update.detach().clone()  # mu_0 = 0
                    else:
                        buf.mul_(momentum).add_(update)
                    update = buf
                p.add_(update, alpha=-lr)
        return loss


# ------------------------------------------------------------------------- factory
def build_optimizer(name: str, params: Iterable[Any], lr: float, weight_decay: float, momentum: float = 0.9,
                    betas: tuple[float, float] = (0.9, 0.999)) -> Optimizer:
    """A plain optimizer by name: sgd (with momentum), lars, adam, adamw."""
    key = name.lower() if isinstance(name, str) else name
    if key == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; known optimizers are {', '.join(OPTIMIZER_NAMES)}")
