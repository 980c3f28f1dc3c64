"""A simulated W-rank job in this process, with no GPU and no memory behind its tensors.

`fake_cluster(world)` gives rank 0 of a ``"fake"`` process group (torch's FakeStore: every collective returns at
once) and a `FakeTensorMode` in which tensors have shapes, dtypes and devices but no storage. The device is the
CPU: fake *CUDA* tensors run a forward (autocast included, with `amp_definitely_not_available` and
`is_bf16_supported` patched), but the autograd engine's CUDA device threads need a CUDA runtime for the backward
(``hasPrimaryContext expects a valid device index``), and FSDP2 creates CUDA streams: the measured step runs
on fake CPU tensors, and ``fake_cluster(world, "cuda")`` runs the rest of the GPU code path (AutocastCUDA,
torch.nn.SyncBatchNorm with shape-only kernels, DDP on a device, the optimizer) on fake CUDA tensors.
What has to be patched for the production step to run there, and why:

* the model is built on the meta device outside fake mode (`_built_on_meta`), then moved onto the fake device;
* `Module.to` must swap FakeTensor parameters, which fails while the fake converter's memo holds weak references
  to them: the memo of this mode holds them strongly instead (metadata only, nothing is allocated);
* DDP's C++ reducer cannot run on storage-less tensors (nor record its CUDA timers): DDP runs its Python reducer (the one used under
  compiled autograd: one all-reduce of each gradient), and its construction-time checks of the other ranks'
  shapes and its broadcast from rank 0 (every rank is seeded identically) are skipped;
* FSDP2's default mesh is a mesh of the fake group, created before entering fake mode (``init_device_mesh``
  reads the ranks' coordinates from tensor values).

Host synchronisations (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask indexing) cannot run on fake tensors:
`HostSyncRecorder` records each with the first frame outside torch that caused it and lets the step go on (a
boolean mask counts as all True, a scalar as 1 / True).
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


_SYNCBN_LIB: list[Any] = []
_CUDA_RUN = [False]   # inside fake_cluster(..., "cuda")


def _register_syncbn_meta() -> None:
    """Shape-only kernels of the CUDA-only ops of torch.nn.SyncBatchNorm (torch has no meta kernel for them)."""
    if _SYNCBN_LIB:
        return
    lib = torch.library.Library("aten", "IMPL")

    def stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape[1], dtype=torch.float32), x.new_empty(x.shape[1], dtype=torch.float32)

    def gather(x, mean, invstd, running_mean, running_var, momentum, eps, counts):
        return mean.new_empty(mean.shape[-1]), mean.new_empty(mean.shape[-1])

    def backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        c = [mean.new_empty(x.shape[1]) for _ in range(4)]
        return (c[0] if input_g else None, c[1] if input_g else None, c[2] if weight_g else None,
                c[3] if bias_g else None)

    lib.impl("batch_norm_stats", stats, "Meta")
    lib.impl("batch_norm_gather_stats_with_counts", gather, "Meta")
    lib.impl("batch_norm_elemt", lambda x, *rest: torch.empty_like(x), "Meta")
    lib.impl("batch_norm_backward_reduce", backward_reduce, "Meta")
    lib.impl("batch_norm_backward_elemt", lambda dy, x, *rest: torch.empty_like(x), "Meta")
    _SYNCBN_LIB.append(lib)


@dataclass(frozen=True)
class HostSync:
    op: str       # the aten op that needs the value on the host
    where: str    # file:line (function) of the first frame outside torch
    inside: str   # the innermost frame (in torch when torch itself synchronises), else ""
    host_only: bool = False   # a CPU tensor read in a CUDA run: a host read, not a device sync

    def __str__(self) -> str:
        return f"{self.op} at {self.where}" + (f" (inside {self.inside})" if self.inside else "") + (
            " [a CPU tensor: no device sync]" if self.host_only else "")


def _frames() -> tuple[str, str]:
    """(the innermost frame outside torch, the innermost torch frame below it that is torch's own code)."""
    stack = [f for f in traceback.extract_stack() if not f.filename.startswith(_HERE)]

    def fmt(f: traceback.FrameSummary) -> str:
        name = f.filename
        for root in (_TORCH_DIR, os.path.dirname(os.path.dirname(_HERE))):
            if name.startswith(root):
                name = os.path.relpath(name, os.path.dirname(root))
        return f"{name}:{f.lineno} ({f.name})"
    last = max((i for i, f in enumerate(stack) if not f.filename.startswith(_TORCH_DIR)
                and "contextlib" not in f.filename), default=-1)
    where = fmt(stack[last]) if last >= 0 else "?"
    # the torch module that synchronised, when torch itself did (SyncBatchNorm, an optimizer, DDP, FSDP)
    inside = next((fmt(f) for f in reversed(stack[last + 1:]) if any(f"/torch/{part}/" in f.filename for part in _TORCH_PARTS)
                   and "/_tools/" not in f.filename), "")
    return where, inside


_TORCH_PARTS = ("nn", "optim", "distributed", "amp")


class HostSyncRecorder(TorchDispatchMode):
    """Entered inside `FakeTensorMode`: records every op whose result depends on tensor values and substitutes
    a value of the right shape, so the simulated step runs to its end and lists them all."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[HostSync] = []

    def _record(self, op: str, t: torch.Tensor) -> None:
        self.syncs.append(HostSync(op, *_frames(), _CUDA_RUN[0] and t.device.type == "cpu"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            self._record("item()/bool()/float() (_local_scalar_dense)", args[0])
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        if func in (aten.nonzero.default, aten.argwhere.default):
            self._record(f"{func.__name__} (output size depends on values)", args[0])
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func is aten.masked_select.default:
            self._record("masked_select (output size depends on values)", args[0])
            x, mask = args[0], args[1]
            return torch.empty(torch.broadcast_shapes(x.shape, mask.shape).numel(), dtype=x.dtype, device=x.device)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
            indices = args[1]
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._record(f"{func.__name__} with a boolean mask (output size depends on values)", args[0])
                args = (args[0], _all_true(indices), *args[2:])
        return func(*args, **kwargs)


def _all_true(indices: list[Any]) -> list[Any]:
    """Boolean masks -> the long indices of an all-True mask of the same shape."""
    out: list[Any] = []
    for i in indices:
        if i is None or i.dtype not in (torch.bool, torch.uint8):
            out.append(i)
            continue
        grids = torch.meshgrid(*[torch.arange(n, device=i.device) for n in i.shape], indexing="ij")
        out.extend(g.reshape(-1) for g in grids)
    return out


class _StrongMemo(dict):
    """The fake converter's memo, holding its values strongly (`Module.to` cannot swap weakly referenced ones)."""


@contextlib.contextmanager
def fake_cluster(world: int, device_type: str = "cpu") -> Iterator[tuple[Any, torch.device]]:
    """Rank 0 of a simulated `world`-rank job on fake tensors of `device_type`; yields (fake mode, device).
    ``cuda``: the GPU code paths (AutocastCUDA, torch.nn.SyncBatchNorm, FSDP2's bf16 policy, DDP on a device)
    for everything but a backward (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unison.training.model import build_method

    if dist.is_initialized():
        raise RuntimeError("unison plan needs this process without a process group")
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    if device.type == "cuda":
        _register_syncbn_meta()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            # ZeRO-1 tells aliased state tensors apart by data_ptr, which fake storages still answer
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            for target, value in _patches().items():
                stack.enter_context(mock.patch(target, value))
            world_group = dist.group.WORLD
            assert world_group is not None   # initialised above
            mesh = DeviceMesh.from_group(world_group, device.type)
            for where in ("_fsdp_init", "_fully_shard"):   # fully_shard's own name of it, and the original
                stack.enter_context(mock.patch(f"torch.distributed.fsdp._fully_shard.{where}._init_default_mesh",
                                               lambda *a, **k: mesh))
            stack.enter_context(mock.patch("unison.training.step.build_method", _built_on_meta(build_method)))
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            mode.fake_tensor_converter.meta_converter.tensor_memo = _StrongMemo()  # type: ignore[assignment]
            with mode:
                _CUDA_RUN[0] = device.type == "cuda"
                try:
                    yield mode, device
                finally:
                    _CUDA_RUN[0] = False
    finally:
        dist.destroy_process_group()


def _built_on_meta(build_method: Any) -> Any:
    """`build_method` run outside fake mode on the meta device (FakeTensorMode cannot deepcopy a module, which
    the momentum teachers do), then moved onto the fake device: the same model, never allocated."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def build(cfg: Any, total_steps: int, dtype: torch.dtype, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), torch.device("meta"):
            method = build_method(cfg, total_steps, dtype, torch.device("meta"), *args, **kwargs)
        return method.to(device, dtype)

    return build


def _patches() -> dict[str, Any]:
    import torch._dynamo  # noqa: F401  (the config patched below)

    none = lambda *a, **k: None  # noqa: E731
    return {
        "torch.cuda.amp.common.amp_definitely_not_available": lambda: False,
        "torch.cuda.is_bf16_supported": lambda *a, **k: True,
        "torch.cuda.current_device": lambda: 0,
        "torch.cuda.device_count": lambda: 1,
        "torch.cuda.get_device_capability": lambda *a, **k: (9, 0),   # sm_90's (dist.broadcast asks)
        "torch._dynamo.config.optimize_ddp": "python_reducer",
        "torch.nn.parallel.distributed._verify_param_shape_across_processes": none,
        "torch.nn.parallel.distributed._sync_module_states": none,
    }
