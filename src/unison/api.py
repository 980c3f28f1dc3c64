"""The programmatic API: plain functions with keyword arguments, what the CLI's commands also call.

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="byol", epochs=10))        # -> Summary (rank 0's)
    backbone = unison.load_backbone("runs/default")                      # -> nn.Module, trained weights, eval mode
    scores = unison.evaluate("runs/default", knn_k=20, linear=False)     # -> dict: knn_top1, linear_top1, ...
    unison.embed("runs/default", "photos/", "photos.npy")                # features of every image, in input order
    unison.export("runs/default", "backbone.pt")                         # the backbone's state_dict + its .json
    report = unison.check("simclr", world_size=2)                        # -> CheckReport

    # your own pieces in unison's loop (guide: "Bring your own model, data or loop"): module-level classes/functions
    summary = unison.train(cfg, backbone=MyNet(), feature_dim=512, dataset=MyPhotos(), transform=my_views)
    scores = unison.evaluate(summary.out, dataset=MyLabelled("train"), val=MyLabelled("val"))

`train` validates the configuration and checks the data, checkpoint and run directory before any worker
starts, then trains (`unison.training.run`). A failure is a `unison.errors` exception with a one-line message.
`run` is a run directory (its latest checkpoint) or a checkpoint file, as ``--checkpoint`` takes it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.training.summary import Summary

if TYPE_CHECKING:   # for annotations only: the check and eval packages are imported when first used
    import torch
    import torch.nn as nn

    from unison.equivalence.steps import CheckReport

__all__ = ["check", "embed", "evaluate", "export", "load_backbone", "train"]

Run = str | os.PathLike[str]


def train(cfg: TrainConfig, *, backbone: nn.Module | None = None, feature_dim: int | None = None,
          dataset: Any = None, transform: Callable[[Any], Any] | None = None, val: Any = None,
          isolated: bool = False) -> Summary:
    """Train as `cfg` says; return the run's `Summary` (also written to ``<out>/summary.json``).

    Your own pieces replace unison's (guide: "Bring your own model, data or loop"): `backbone` (an ``nn.Module`` returning
    ``[batch, feature_dim]``) with its `feature_dim`, `dataset` (a ``Dataset``/``IterableDataset`` of images) and
    `transform` (image -> view or list of views). They are not modified; above one worker they are sent to the
    worker processes pickled (module-level classes and functions). `val`: labelled held-out images (a ``Dataset`` of
    ``(image, label)`` items, or with a ``targets`` list) for the run's kNN against `dataset`'s labelled items;
    afterwards, `evaluate` with ``dataset=`` and ``val=`` gives kNN and linear probe.
    `isolated`: run even a single worker in a fresh process (benchmarks: each run's peak memory
    and thread settings are its own).

    Example::

        summary = unison.train(TrainConfig(method="simclr", max_steps=100, out="runs/a"))
        print(summary.knn_top1)
    """
    from unison.training.pieces import OwnPieces
    from unison.training.run import run_training

    own = OwnPieces(backbone, feature_dim, dataset, transform, val)
    return run_training(cfg, isolated=isolated, own=own if own.given else None)


def check(method: str = "simclr", world_size: int = 2, *, backbone: nn.Module | None = None,
          feature_dim: int | None = None, dataset: Any = None, transform: Callable[[Any], Any] | None = None,
          **options: Any) -> CheckReport:
    """`unison check`: the production step at `world_size` workers against one process on the global batch;
    with your own `backbone` (and `feature_dim`), `dataset` and `transform` as `train` takes them.

    Example::

        assert unison.check("byol", world_size=2).passed
    """
    from unison.equivalence import run_equivalence
    from unison.training.pieces import OwnPieces

    own = OwnPieces(backbone, feature_dim, dataset, transform)
    return run_equivalence(method, world_size, own=own if own.given else None, **options)


def load_backbone(run: Run, *, backbone: nn.Module | None = None,
                  device: str | torch.device = "cpu") -> nn.Module:
    """The trained backbone of `run` (a run directory or checkpoint file): an ``nn.Module`` in eval mode with the
    run's weights, returning ``[batch, feature_dim]`` for images normalised as the run's (its ``config.json``:
    ``resolved.image_size``, ``mean``, ``std``), on `device` (``cpu``, ``cuda``, ``cuda:N``, ``auto``; one that is not
    a device, or not on this machine, is a one-line `ConfigError`).

    `backbone`: a module of yours to load the run's backbone weights into, returned (in eval mode) instead of the
    rebuilt one. The load is strict: its ``state_dict`` must have exactly the keys and shapes of the trained
    backbone's, else a one-line `ConfigError` names the differences (nothing is loaded). For a run of your own
    backbone class, pass an instance of it (needed when the class cannot be built without arguments; without one
    the class is imported and built without arguments); for unison's backbones, any module of the same layout (a
    ``resnet18_imagenet`` run: ``torchvision.models.resnet18()`` with ``fc = torch.nn.Identity()``).

    Example::

        net = unison.load_backbone("runs/default")
        features = net(images)          # float [B, 3, H, W] normalised -> [B, feature_dim]
    """
    from unison.training.load import load_method

    method, _, _ = load_method(_path(run), device, backbone=backbone)
    return method.backbone.eval()


def evaluate(run: Run | Any = None, *, dataset: Any = None, val: Any = None, backbone: nn.Module | None = None,
             **options: Any) -> dict[str, Any]:
    """`unison eval`: kNN and linear-probe top-1 of `run`'s backbone (a run directory or checkpoint file). The
    keyword arguments are ``unison eval``'s options (``data``, ``val``, ``knn_k``, ``linear=False``, ...);
    an `EvalOptions` is taken as well, as `run`. Data default to the run's. Your own labelled data:
    `dataset` (reference images) and `val` (held-out images), ``Dataset`` objects of ``(image, label)`` items
    (or with a ``targets`` list); `backbone`: an instance for a run of your own backbone class that cannot be
    built without arguments.

    Example::

        unison.evaluate("runs/default")                                # the run's data: {"knn_top1": ..., ...}
        unison.evaluate("runs/a", data="photos/", val="held_out/", linear=False)
        unison.evaluate("runs/mine", dataset=ImageFolder("train/"), val=ImageFolder("val/"))
    """
    from unison.evaluation import EvalOptions, evaluate_checkpoint

    if isinstance(val, (str, os.PathLike)):   # a path, as --val
        options["val"], val = os.fspath(val), None
    if isinstance(dataset, (str, os.PathLike)):   # a path, as --data
        options["data"], dataset = os.fspath(dataset), None
    if isinstance(run, EvalOptions):
        if options:
            raise ConfigError(f"evaluate: give the options in the EvalOptions or as keywords, not both "
                              f"({', '.join(sorted(options))})")
        opts = run
    else:
        if run is None:
            raise ConfigError("evaluate: give the run, e.g. unison.evaluate('runs/default')")
        opts = _options(EvalOptions, "evaluate", checkpoint=os.fspath(_path(run)), **options)
    return evaluate_checkpoint(opts, backbone=backbone, dataset=dataset, val=val)


def embed(run: Run, data: str | os.PathLike[str] | None = None, out: str | os.PathLike[str] | None = None,
          **options: Any) -> dict[str, Any]:
    """`unison embed`: the backbone features of every image of `data` (a folder, file list or .tar shards; default:
    the run's training data), in input order. With `out` (a ``.npy``) they go there and the file names to ``OUT.names.csv``; without it the
    result holds them: ``features`` (float32 ``[N, feature_dim]``) and ``files``, ``labels`` (the class names,
    empty for unlabelled images). Other keywords: ``unison embed``'s options (``world_size``, ``batch_size``, ...).

    Example::

        r = unison.embed("runs/default", "photos/")
        r["features"].shape, r["files"][:3]
    """
    from unison.embedding import EmbedOptions
    from unison.embedding import embed as embed_images

    data = None if data is None else os.fspath(data)
    if out is not None:
        return embed_images(_options(EmbedOptions, "embed", checkpoint=os.fspath(_path(run)), data=data,
                                     out=os.fspath(out), **options))
    import csv

    import numpy as np

    with tempfile.TemporaryDirectory(prefix="unison-embed-") as tmp:
        r = embed_images(_options(EmbedOptions, "embed", checkpoint=os.fspath(_path(run)), data=data,
                                  out=str(Path(tmp) / "features.npy"), **options))
        with open(r["names"], encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        features = np.load(r["out"])
    return {**{k: v for k, v in r.items() if k not in ("out", "names")}, "features": features,
            "files": [row["file"] for row in rows], "labels": [row["label"] for row in rows]}


def export(run: Run, out: str | os.PathLike[str], *, format: str | None = None) -> dict[str, Any]:
    """`unison export`: `run`'s backbone as a plain state dict (``.pt``, or ``.safetensors``: `format` or the
    suffix of `out`) with its preprocessing beside it in ``<out>.json``; returns what was written.

    Example::

        info = unison.export("runs/default", "backbone.pt")
        net.load_state_dict(torch.load(info["path"]))
    """
    from unison.export import export_backbone

    return export_backbone(_path(run), os.fspath(out), format)


def _path(run: Any) -> Path:
    if not isinstance(run, (str, os.PathLike)):
        raise ConfigError(f"give the run as a path (a run directory or checkpoint file), not {type(run).__name__}")
    return Path(run)


def _options(cls: type, what: str, **values: Any) -> Any:
    """`cls` (`EvalOptions`, `EmbedOptions`) from keyword arguments; an unknown one is one line naming the known."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{what}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**values)
