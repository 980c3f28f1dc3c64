"""The programmatic API: what the CLI, ``unison check --run`` and ``unison bench`` call.

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="byol", epochs=10))     # -> Summary (rank 0's)
    report = unison.check("simclr", world_size=2)                      # -> CheckReport
    scores = unison.evaluate(EvalOptions(checkpoint="runs/default"))   # -> dict

`train` validates the configuration and checks the data, checkpoint and run directory
before any worker starts, then trains: in this process when it is itself a worker
(torchrun, srun, mpirun started it) or when one worker is asked for, else in
``world_size`` processes started by unison's launcher. A failure is a `unison.errors`
exception with a one-line message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unison.config import TrainConfig
from unison.train.summary import Summary

if TYPE_CHECKING:   # for annotations only: the check and eval packages are imported when first used
    from unison.check.steps import CheckReport
    from unison.eval.commands import EvalOptions


def train(cfg: TrainConfig, *, isolated: bool = False) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own)."""
    import dataclasses

    from unison.distributed.env import apply_launch_env, detect_launch_env
    from unison.distributed.launch import launch
    from unison.train.loop import train_worker
    from unison.train.preflight import preflight

    launch_env = detect_launch_env()
    launched = launch_env is not None
    if launch_env is not None:   # torchrun/srun/mpirun decide the world size: validate the batch split for theirs
        cfg = dataclasses.replace(cfg, distributed=apply_launch_env(cfg.distributed, launch_env))
    cfg.validate()
    preflight(cfg, launched=launched)
    if launched or (cfg.distributed.world_size == 1 and not isolated):
        return Summary.from_dict(train_worker(cfg.to_dict()))
    results = launch(train_worker, cfg.to_dict(), cfg.distributed, threads_per_worker=cfg.threads)
    return Summary.from_dict(results[0])


def check(method: str = "simclr", world_size: int = 2, **options: Any) -> CheckReport:
    """`unison check`: the production step at `world_size` workers against one process on the global batch."""
    from unison.check import run_equivalence

    return run_equivalence(method, world_size, **options)


def evaluate(options: EvalOptions) -> dict[str, Any]:
    """`unison eval`: kNN and linear probe of a checkpoint's backbone."""
    from unison.eval.commands import evaluate_checkpoint

    return evaluate_checkpoint(options.validate())
