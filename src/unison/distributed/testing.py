"""Run a function in W real worker processes (gloo on loopback) and collect each rank's result.

Used by unison's tests and by ``unison check``; also handy for users testing their own
distributed code::

    def work(scale):                      # module-level, so it can be pickled
        from unison.distributed import collectives as C
        x = torch.full((2,), float(C.rank() + 1)) * scale
        return C.all_reduce_no_grad(x)

    results = run_in_workers(work, world_size=2, args=(3.0,))   # [tensor([9., 9.]), tensor([9., 9.])]

Results travel back to the caller through the launcher's pipes (`unison.distributed.launch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unison.config.distributed import DistributedConfig

from .env import detect_launch_env, init_distributed, shutdown_distributed
from .launch import launch


def _run_one(payload: dict[str, Any]) -> Any:
    launch_env = detect_launch_env()
    assert launch_env is not None
    cfg = DistributedConfig(backend=payload["backend"], world_size=launch_env.world_size, rank=launch_env.rank,
                            master_addr=launch_env.master_addr or "127.0.0.1", master_port=launch_env.master_port or 0,
                            timeout_s=payload["timeout_s"])
    init_distributed(cfg, launch_env.local_rank)
    error: BaseException | None = None
    try:
        torch.manual_seed(payload["seed"] + launch_env.rank)
        return payload["fn"](*payload["args"])
    except BaseException as exc:
        error = exc
        raise
    finally:
        shutdown_distributed(error)


def run_in_workers(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str = "gloo",
                   seed: int = 0, timeout_s: float = 120.0, threads_per_worker: int = 1) -> list[Any]:
    """Call `fn(*args)` on every rank of a fresh `world_size`-process group; return results by rank."""
    if world_size == 1 and backend == "local":
        init_distributed(DistributedConfig(backend="local", world_size=1))
        try:
            torch.manual_seed(seed)
            return [fn(*args)]
        finally:
            shutdown_distributed(None)   # one process: nothing to wait for
    cfg = DistributedConfig(backend=backend, world_size=world_size, timeout_s=timeout_s)
    payload = {"fn": fn, "args": args, "backend": backend, "seed": seed, "timeout_s": timeout_s}
    return launch(_run_one, payload, cfg, threads_per_worker=threads_per_worker)
