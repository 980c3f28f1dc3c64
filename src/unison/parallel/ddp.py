"""DDP wiring from a `DistributedConfig`.

* ``find_unused_parameters`` passed through.
* ``grad_sync_every=K``: `grad_sync_context(model, micro_step, K)` returns DDP's
  ``no_sync()`` for the first K-1 micro-batches of each optimiser step; the forward must run
  inside it (``--accumulation independent``: NOT a bigger batch for batch-coupled losses). The
  default, exact accumulation (`unison.training.accumulate`), runs the whole step under ``no_sync``
  and averages the gradients itself.
* Gradient compression through DDP comm hooks: ``fp16`` (any backend), ``bf16`` (CUDA+NCCL
  only; refused by config validation elsewhere), ``powersgd`` (rank ``powersgd_rank``,
  error feedback, warm start, ``start_powerSGD_iter = powersgd_start_iter``; 1-D tensors go
  uncompressed; its state is checkpointed by parameter, `unison.parallel.powersgd_state`).
* State that must never be re-broadcast — queues, DINO centres, momentum encoders — is
  declared with `mark_rank_local_state(module, ...)` and excluded from DDP by fully
  qualified name. With SyncBN the running statistics are already identical on every rank,
  so DDP's per-step buffer broadcast is switched off altogether.

Example::

    model = wrap_ddp(method, cfg, device)
    with grad_sync_context(model, micro_step, cfg.grad_sync_every):
        loss = model(views) / cfg.grad_sync_every
        loss.backward()
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from unison.config.distributed import DistributedConfig
from unison.distributed.tagging import rank_local_state_names

_HOOK_STATE_ATTR = "_unison_comm_hook_state"


def comm_hook_for(cfg: DistributedConfig, metered: bool = False):
    """(hook, state) for DDP's `register_comm_hook`, or None for DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if cfg.grad_compression == "fp16":
        return default_hooks.fp16_compress_hook, None
    if cfg.grad_compression == "bf16":
        return default_hooks.bf16_compress_hook, None
    if cfg.grad_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_iter,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        return powerSGD_hook.powerSGD_hook, state
    if metered:
        return default_hooks.allreduce_hook, None  # same maths as the C++ default, visible to CommMeter
    return None


def wrap_ddp(model: nn.Module, cfg: DistributedConfig, device: torch.device, *, metered: bool = False,
             bucket_cap_mb: float = 25.0) -> DDP:
    """Wrap `model` (already on `device`, SyncBN already converted if wanted) in DDP per `cfg`."""
    if not dist.is_initialized():
        raise RuntimeError("wrap_ddp needs an initialised process group (unison.distributed.env.init_distributed)")
    ignored = rank_local_state_names(model)
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    # torch >= 2.12 renamed the per-forward buffer broadcast; rank-local state is ignored either way.
    buffer_flag = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                   else "broadcast_buffers")
    buffer_kwargs: dict[str, Any] = {buffer_flag: not cfg.sync_batchnorm}
    ddp = DDP(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        **buffer_kwargs,
        find_unused_parameters=cfg.find_unused_parameters,
        bucket_cap_mb=bucket_cap_mb,
    )
    hook = comm_hook_for(cfg, metered)
    if hook is not None:
        fn, state = hook
        if cfg.grad_compression == "powersgd":   # its state goes into checkpoints, keyed by parameter
            from .powersgd_state import CheckpointablePowerSGD

            checkpointable = CheckpointablePowerSGD(state, model)
            fn = checkpointable.hook
            setattr(ddp, _HOOK_STATE_ATTR, checkpointable)
        ddp.register_comm_hook(state, fn)
    return ddp


def comm_hook_checkpoint_state(ddp: nn.Module):
    """The checkpointable state of `ddp`'s comm hook (PowerSGD's error feedback, ...), or None."""
    return getattr(ddp, _HOOK_STATE_ATTR, None)


def grad_sync_context(model: nn.Module, micro_step: int, grad_sync_every: int):
    """`no_sync()` unless this micro-batch is the last of its accumulation window (FSDP: its equivalent)."""
    last = (micro_step + 1) % grad_sync_every == 0
    if grad_sync_every > 1 and not last:
        if isinstance(model, DDP):
            return model.no_sync()
        from .fsdp import gradient_sync, is_fsdp

        if is_fsdp(model):
            return gradient_sync(model, enabled=False)
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model
