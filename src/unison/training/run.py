"""`run_training(cfg)`: validate, check what a run needs before any worker starts, then train.

What `unison.train` (the API), `unison train` (the CLI) and `unison check --run` all call. The run trains
in this process when it is itself a worker (torchrun, srun, mpirun started it) or when one worker is asked
for, else in ``world_size`` processes started by unison's launcher. The run directory has one owner for
the run's life (`unison.training.owner`): this process, or rank 0 when a launcher started the workers. A
failure is a `unison.errors` exception with a one-line message.

Example::

    summary = run_training(TrainConfig(method="moco", epochs=10))   # -> Summary (rank 0's)
"""

from __future__ import annotations

import contextlib
import dataclasses

from unison.config import TrainConfig
from unison.config.distributed import as_distributed
from unison.distributed.env import apply_launch_env, check_backend_launcher, check_gpu_per_worker, detect_launch_env
from unison.distributed.launch import launch
from unison.distributed.start import refuse_reentered_main, refuse_unimportable_main
from unison.distributed.watchdog import watched_startup

from .owner import RunDirLock
from .pieces import OwnPieces
from .preflight import check_model_memory, preflight, set_aside_other_run
from .resolve import resolve_run
from .summary import Summary
from .trainer import train_worker, train_worker_own


def run_training(cfg: TrainConfig, *, isolated: bool = False, own: OwnPieces | None = None) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own). `own`: the user's backbone, dataset and transform (`unison.training.own`),
    sent to unison's worker processes pickled."""
    refuse_reentered_main("unison.train")   # a script without the main guard, re-run by a worker
    cfg.distributed = as_distributed(cfg.distributed)   # read below, before the fields are validated
    launch_env = detect_launch_env()
    launched = launch_env is not None
    check_backend_launcher(cfg.distributed, launch_env)   # before anything starts
    if launch_env is not None:   # torchrun/srun/mpirun decide the world size: validate the batch split for theirs
        cfg = dataclasses.replace(cfg, distributed=apply_launch_env(cfg.distributed, launch_env))
    check_gpu_per_worker(cfg.distributed, launch_env)   # NCCL: a GPU per worker, before any worker starts
    in_process = launched or (cfg.distributed.world_size == 1 and not isolated)
    if not in_process:   # before anything is read or written: the launch would refuse it only then
        refuse_unimportable_main(cfg.distributed.world_size)
    with watched_startup(cfg.distributed.watchdog_s, "checking the data before training (listing it, reading "
                         "its first images or your dataset's first items)"):
        plan = resolve_run(cfg, own=own)   # the run, decided once: the workers build from it
        if own is not None and not in_process:
            from .own import check_picklable

            check_picklable(own)   # before anything is written: the pieces travel to the workers pickled
        if own is None or own.backbone is None:   # the user's backbone is checked by one forward (`check_pieces`)
            check_model_memory(plan)   # a model that cannot fit: one line here, not a huge failed allocation per worker
        preflight(plan, launched=launched, own=own)
    owner = launch_env is None or launch_env.rank == 0   # unison's workers (train_worker) never lock
    with RunDirLock(cfg.out) if owner else contextlib.nullcontext():
        if owner:
            set_aside_other_run(cfg)   # a run never mixes its files with those of the run it replaces
        if in_process:
            return Summary.from_dict(train_worker(plan, own))
        if own is not None:
            results = launch(train_worker_own, {"plan": plan, "own": own}, cfg.distributed,
                             threads_per_worker=cfg.threads)
        else:
            results = launch(train_worker, plan, cfg.distributed, threads_per_worker=cfg.threads)
        return Summary.from_dict(results[0])
