"""The programmatic API: what the CLI, ``unison check --run`` and ``unison bench`` call.

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="byol", epochs=10))     # -> Summary (rank 0's)
    report = unison.check("simclr", world_size=2)                      # -> CheckReport
    scores = unison.evaluate(EvalOptions(checkpoint="runs/default"))   # -> dict

`train` validates the configuration and checks the data, checkpoint and run directory
before any worker starts, then trains (`unison.training.run`). A failure is a `unison.errors`
exception with a one-line message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unison.config import TrainConfig
from unison.training.summary import Summary

if TYPE_CHECKING:   # for annotations only: the check and eval packages are imported when first used
    from unison.equivalence.steps import CheckReport
    from unison.evaluation import EvalOptions


def train(cfg: TrainConfig, *, isolated: bool = False) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own)."""
    from unison.training.run import run_training

    return run_training(cfg, isolated=isolated)


def check(method: str = "simclr", world_size: int = 2, **options: Any) -> CheckReport:
    """`unison check`: the production step at `world_size` workers against one process on the global batch."""
    from unison.equivalence import run_equivalence

    return run_equivalence(method, world_size, **options)


def evaluate(options: EvalOptions) -> dict[str, Any]:
    """`unison eval`: kNN and linear probe of a checkpoint's backbone."""
    from unison.evaluation import evaluate_checkpoint

    return evaluate_checkpoint(options.validate())
