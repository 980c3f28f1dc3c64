"""The memory a run's model needs, estimated before any worker starts, and a one-line refusal when it cannot fit.

The model is the production one (`unison.training.step.build_method`, what train, check, plan and the benchmarks
build), built on the ``meta`` device: shapes and dtypes, nothing allocated. Its parameters, buffers, gradients and
optimizer state must fit in this machine's memory: RAM for every worker process the run starts here (the model is
built on the CPU first), and the GPU's memory when the workers train on GPUs. Activations come on top, so a run
that passes can still run out of memory; one that fails here would have failed (the traceback of an allocation of
terabytes, or the kernel's out-of-memory kill) after start-up in every worker.

Example::

    check_model_memory(resolve_run(cfg))   # ConfigError: "the model needs about 8.0 TiB ... lower --param proj_hidden_dim=..."
"""

from __future__ import annotations

import os

import torch

from unison.config import TrainConfig
from unison.config.fields import ascii_digits
from unison.data.memory import physical_memory
from unison.distributed.env import detect_launch_env
from unison.errors import ConfigError
from unison.training.model import build_method
from unison.training.resolve import RunPlan

OPTIMIZER_SLOTS = {"sgd": 1, "lars": 1, "adam": 2, "adamw": 2}   # state tensors per parameter (momentum; m and v)


def model_bytes(plan: RunPlan) -> tuple[int, int, str]:
    """(bytes of the model's parameters and buffers, bytes of its gradients and optimizer state, the name of its
    largest tensor) for the resolved run `plan`, from a build on the meta device."""
    cfg, recipe = plan.cfg, plan.recipe
    meta = torch.device("meta")
    with meta:
        method = build_method(cfg, 1, getattr(torch, cfg.precision), meta, cfg.image_size, backbone=recipe.backbone,
                              teacher_weights=False)
    tensors = {**dict(method.named_parameters()), **dict(method.named_buffers())}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    slots = 1 + OPTIMIZER_SLOTS.get(recipe.optimizer, 2)
    training = slots * sum(p.numel() * p.element_size() for p in method.parameters() if p.requires_grad)
    largest = max(tensors, key=lambda name: tensors[name].numel(), default="")
    return weights, training, largest


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _gpu_memory(cfg: TrainConfig) -> int | None:
    """Memory of one GPU when the workers train on GPUs (as `init_distributed` decides), else None."""
    d = cfg.distributed
    if not torch.cuda.is_available() or not (d.communication_backend() == "nccl" or d.resolved_backend() == "local"):
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def _local_workers(cfg: TrainConfig) -> int:
    """Worker processes on this machine: unison's launcher starts them all here; under torchrun/srun/mpirun only
    torchrun says how many (LOCAL_WORLD_SIZE), else one is assumed (the others may be on other machines)."""
    if detect_launch_env() is None:
        return cfg.distributed.world_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if ascii_digits(local) and 1 <= int(local) <= cfg.distributed.world_size else 1


def check_model_memory(plan: RunPlan) -> None:
    """Raise a one-line `ConfigError` when the model of the resolved run `plan` (parameters, buffers, gradients and
    optimizer state) cannot fit in this machine's memory, naming the size and what to lower."""
    cfg = plan.cfg
    weights, training, largest = model_bytes(plan)
    shards = cfg.distributed.world_size if cfg.distributed.shard == "full" else 1
    per_worker = weights + training // shards
    local = _local_workers(cfg)
    gpu = _gpu_memory(cfg)
    ram = physical_memory()
    if gpu is not None and per_worker > gpu:
        need, have, where = per_worker, gpu, "one GPU has"
    elif ram is not None and (weights if gpu is not None else per_worker) * local > ram:
        need, have = (weights if gpu is not None else per_worker) * local, ram
        where = "this machine has" if local == 1 else f"its {local} worker processes share"
    else:
        return
    given = [f"{k}={v}" for k, v in cfg.method_params.items() if isinstance(v, int) and not isinstance(v, bool)]
    lower = (f"lower --param {', '.join(given)}" if given else "choose a smaller --backbone") + \
        (" or --world-size" if local > 1 and gpu is None else "")
    raise ConfigError(f"the model needs about {_size(need)} (parameters, gradients and optimizer state; the largest "
                      f"tensor is {largest}) and {where} {_size(have)} of memory; {lower}")
