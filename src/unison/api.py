"""The programmatic API: what the CLI, ``unison check --run`` and ``unison bench`` call.

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="byol", epochs=10))     # -> Summary (rank 0's)
    report = unison.check("simclr", world_size=2)                      # -> CheckReport
    scores = unison.evaluate(EvalOptions(checkpoint="runs/default"))   # -> dict

    # your own pieces in unison's loop (docs/api.md, "Your own pieces"): module-level classes/functions
    summary = unison.train(cfg, backbone=MyNet(), feature_dim=512, dataset=MyPhotos(), transform=my_views)
    report = unison.check("simclr", backbone=MyNet(), feature_dim=512, dataset=MyPhotos(), transform=my_views)

`train` validates the configuration and checks the data, checkpoint and run directory
before any worker starts, then trains (`unison.training.run`). A failure is a `unison.errors`
exception with a one-line message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unison.config import TrainConfig
from unison.training.summary import Summary

if TYPE_CHECKING:   # for annotations only: the check and eval packages are imported when first used
    import torch.nn as nn

    from unison.equivalence.steps import CheckReport
    from unison.evaluation import EvalOptions


def train(cfg: TrainConfig, *, backbone: nn.Module | None = None, feature_dim: int | None = None,
          dataset: Any = None, transform: Callable[[Any], Any] | None = None, isolated: bool = False) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    Your own pieces replace unison's (docs/api.md, "Your own pieces"): `backbone` (an ``nn.Module`` returning
    ``[batch, feature_dim]``) with its `feature_dim`, `dataset` (a ``Dataset``/``IterableDataset`` of images) and
    `transform` (image -> view or list of views). They are not modified; above one worker they are sent to the
    worker processes pickled (module-level classes and functions).
    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own)."""
    from unison.training.pieces import OwnPieces
    from unison.training.run import run_training

    own = OwnPieces(backbone, feature_dim, dataset, transform)
    return run_training(cfg, isolated=isolated, own=own if own.given else None)


def check(method: str = "simclr", world_size: int = 2, *, backbone: nn.Module | None = None,
          feature_dim: int | None = None, dataset: Any = None, transform: Callable[[Any], Any] | None = None,
          **options: Any) -> CheckReport:
    """`unison check`: the production step at `world_size` workers against one process on the global batch;
    with your own `backbone` (and `feature_dim`), `dataset` and `transform` as `train` takes them."""
    from unison.equivalence import run_equivalence
    from unison.training.pieces import OwnPieces

    own = OwnPieces(backbone, feature_dim, dataset, transform)
    return run_equivalence(method, world_size, own=own if own.given else None, **options)


def evaluate(options: EvalOptions) -> dict[str, Any]:
    """`unison eval`: kNN and linear probe of a checkpoint's backbone."""
    from unison.evaluation import evaluate_checkpoint

    return evaluate_checkpoint(options.validate())
