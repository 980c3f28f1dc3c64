"""`run_training(cfg)`: validate, check what a run needs before any worker starts, then train.

What `unison.train` (the API), `unison train` (the CLI) and `unison check --run` all call. The run trains
in this process when it is itself a worker (torchrun, srun, mpirun started it) or when one worker is asked
for, else in ``world_size`` processes started by unison's launcher. A failure is a `unison.errors`
exception with a one-line message.

Example::

    summary = run_training(TrainConfig(method="byol", epochs=10))   # -> Summary (rank 0's)
"""

from __future__ import annotations

import dataclasses

from unison.config import TrainConfig
from unison.distributed.env import apply_launch_env, detect_launch_env
from unison.distributed.launch import launch

from .loop import train_worker
from .preflight import preflight
from .resolve import validate_run
from .summary import Summary


def run_training(cfg: TrainConfig, *, isolated: bool = False) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own)."""
    launch_env = detect_launch_env()
    launched = launch_env is not None
    if launch_env is not None:   # torchrun/srun/mpirun decide the world size: validate the batch split for theirs
        cfg = dataclasses.replace(cfg, distributed=apply_launch_env(cfg.distributed, launch_env))
    validate_run(cfg)
    preflight(cfg, launched=launched)
    if launched or (cfg.distributed.world_size == 1 and not isolated):
        return Summary.from_dict(train_worker(cfg.to_dict()))
    results = launch(train_worker, cfg.to_dict(), cfg.distributed, threads_per_worker=cfg.threads)
    return Summary.from_dict(results[0])
