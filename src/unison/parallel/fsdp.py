"""Full sharding with FSDP2 (``--shard full``): parameters, gradients and optimizer state split over the ranks.

`build_run` calls `apply_fsdp(method, device, amp=..., reshard_after_forward=...)` instead of `wrap_ddp` (torchtitan style: small
functions that apply one kind of parallelism to a built model, in place):

* **Units.** ``fully_shard`` is applied bottom-up: to every block of every backbone (the
  children of the backbone's Sequential/ModuleList containers, `backbone_blocks`: a timm
  ViT's ``blocks``, a ResNet's residual blocks, the small CNN's conv and BN layers), then to
  each backbone and each head as a whole (the method's direct children), then to the method
  (the root, holding whatever is left). A unit's parameters are all-gathered just before
  its forward and freed after it (``--reshard-after-forward``, default on), gradients are
  reduce-scattered, so a rank holds 1/W of every parameter, gradient and optimizer state
  plus one gathered unit at a time.
* **Exactness.** FSDP's reduce-scatter averages gradients over ranks as DDP's all-reduce
  does, and every rank's loss is already the local mean of a global-batch loss, so the
  sharded step computes exactly what DDP computes (``unison check --shard full``).
* **Teachers** (BYOL's target, MoCo's key encoder, DINO's teacher) are deep copies of the
  student with the same structure, so they are sharded into the same units with the same
  dim-0 slices: the EMA ``t <- m t + (1 - m) s`` runs on the local shards, elementwise and
  exact, without gathering anything. Their units always reshard after forward (they never
  run a backward that would free them).
* **Frozen teachers** of another architecture (distill's, held as ``teacher.backbone``) are sharded block by
  block too; frozen, they reshard after their one forward of a step: gathered once per step.
* **Rank-local state** (`mark_rank_local_state`): FSDP shards parameters only; buffers
  (queues, DINO's centre, step counters, batch-norm statistics) stay plain, per-rank
  tensors that FSDP never broadcasts, exactly as under DDP. A sharded teacher cannot be
  broadcast from rank 0 at its first forward (`broadcast_once` skips DTensors), so the
  parameters and the non-rank-local buffers are broadcast from rank 0 *before* sharding,
  as DDP does at construction.
* **Parameters a method reads directly** rather than through a submodule's forward (SwAV's
  prototypes: ``F.linear(z, self.prototypes.weight)``) must be gathered by the method's own
  forward, so `SSLMethod.unsharded_children` names them and they stay in the root unit.
* **Mixed precision** (GPU, ``--amp bf16``): ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``: the gathered parameters are bf16, the gradients are reduced and
  kept in fp32, the sharded parameters (what the optimizer updates) stay fp32.
* ``method.embed`` (kNN evaluation) is registered with ``register_fsdp_forward_method`` so
  it gathers like a forward; every rank must call it equally often (`knn_accuracy` does).

`apply_activation_checkpointing(method)` (``--activation-checkpointing``, any sharding)
recomputes each student backbone block's activations in the backward. Blocks that hold
batch norm are left alone: recomputing them would update the running statistics twice.

torch >= 2.6 exposes FSDP2 as ``torch.distributed.fsdp``; torch 2.4/2.5 as
``torch.distributed._composable.fsdp`` (same API).

Example::

    method = apply_fsdp(method, device, amp=..., reshard_after_forward=...)              # in place; returns the method
    optimizer = build_optimizer("lars", method.parameters(), lr=0.3, weight_decay=1e-6)
    with gradient_sync(method, enabled=is_last_micro_batch):
        method(views).backward()
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from unison.distributed.collectives import broadcast_, world_size
from unison.distributed.tagging import rank_local_state_names

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # type: ignore

try:
    from torch.distributed.fsdp import register_fsdp_forward_method
except ImportError:  # torch 2.4 / 2.5
    try:
        from torch.distributed._composable.fsdp import register_fsdp_forward_method  # type: ignore
    except ImportError:
        register_fsdp_forward_method = None  # type: ignore[assignment]

__all__ = ["FSDPModule", "apply_activation_checkpointing", "apply_fsdp", "backbone_blocks", "gradient_sync",
           "is_fsdp"]

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def backbone_blocks(backbone: nn.Module) -> list[nn.Module]:
    """The blocks of a backbone: the children (with parameters) of its Sequential/ModuleList children.

    timm ViT: ``blocks.0 ... blocks.11``; torchvision ResNet: the residual blocks of
    ``layer1 ... layer4``; the small CNN: each conv and BN layer of ``features``.
    """
    return [block for child in backbone.children() if isinstance(child, _CONTAINERS)
            for block in child.children() if _has_params(block)]


def _is_backbone_like(child: nn.Module, method: nn.Module) -> bool:
    """The backbone and its momentum copies (same class): sharded block by block."""
    backbone = getattr(method, "backbone", None)
    return backbone is not None and type(child) is type(backbone)


def _has_no_forward(module: nn.Module) -> bool:
    """A module that is never called itself (a teacher holding copies, a ModuleDict): FSDP hooks on it would
    never run, so its children are the units."""
    return type(module).forward is nn.Module.forward


def _frozen(module: nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters())


@torch.no_grad()
def _broadcast_from_rank0(method: nn.Module) -> None:
    """Parameters and the non-rank-local buffers <- rank 0's (what DDP does at construction)."""
    if world_size() == 1:
        return
    local = set(rank_local_state_names(method))
    for p in method.parameters():
        broadcast_(p.data)
    for name, b in method.named_buffers():
        if name not in local:
            broadcast_(b)


def mixed_precision_policy(amp: str, device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 gathered parameters with fp32 gradient reduction for ``--amp bf16`` on GPU; else none."""
    if amp == "bf16" and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(method: nn.Module, device: torch.device, *, amp: str = "none",
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard `method` (SyncBN already converted, on `device`) in place, per block; returns it.

    `amp` (none | bf16 | fp16) picks FSDP's mixed-precision policy; `reshard_after_forward` frees the gathered
    parameters after each unit's forward (ZeRO-3) or keeps them to the backward (ZeRO-2)."""
    unsharded = set(getattr(method, "unsharded_children", ()))
    with torch.no_grad():   # FSDP2 shards contiguous parameters only (not channels_last conv weights);
        for p in method.parameters():   # channels_last activations still run as such
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    _broadcast_from_rank0(method)
    policy = mixed_precision_policy(amp, device)
    kw: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    reshard = reshard_after_forward

    def shard(module: nn.Module) -> None:
        fully_shard(module, reshard_after_forward=reshard or _frozen(module), **kw)

    def shard_children(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if (parent is method and name in unsharded) or not _has_params(child):
                continue
            if _has_no_forward(child):   # a holder of modules used one by one (MomentumTeacher): shard those
                shard_children(child)
                continue
            if _is_backbone_like(child, method) or name == "backbone":   # also a holder's (distill's teacher)
                for block in backbone_blocks(child):
                    shard(block)
            shard(child)

    shard_children(method)
    # The root unit stays gathered from its forward to its backward (FSDP would gather it again at once):
    # forward and backward then see the same values even where a forward writes into a parameter it holds
    # (SwAV normalises its prototypes in place).
    fully_shard(method, reshard_after_forward=False, **kw)
    if register_fsdp_forward_method is not None and hasattr(method, "embed"):
        register_fsdp_forward_method(method, "embed")
    # torch warns when a unit returns a view (a backbone's Flatten, a ViT's class token), in case the caller
    # modifies it in place, which would skip FSDP's pre-backward hook. No method does (unison check --shard full
    # compares every gradient with one process), so the warning is noise in every run.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return method


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce-scatter gradients in the backward inside this context only if `enabled` (FSDP's no_sync).

    Without synchronisation the unsharded gradients accumulate locally (memory of a full
    gradient) until the backward of a micro-batch with `enabled=True`.
    """
    if enabled or not is_fsdp(model):
        yield
        return
    fsdp_model: Any = model
    fsdp_model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        fsdp_model.set_requires_gradient_sync(True)


# ------------------------------------------------------------------ activation checkpointing
def _has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():   # evaluation and teachers: nothing to save
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(method: nn.Module) -> list[str]:
    """Recompute the student backbone's blocks in the backward (in place); returns the blocks wrapped.

    The block's ``forward`` is replaced on the instance, so module names and state-dict keys
    do not change and FSDP's hooks still run around the (checkpointed) forward.
    """
    backbone = getattr(method, "backbone", None)
    if backbone is None:
        return []
    wrapped = []
    names = {id(m): n for n, m in backbone.named_modules()}
    for block in backbone_blocks(backbone):
        if _has_batchnorm(block) or _frozen(block):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        wrapped.append(names[id(block)])
    return wrapped
