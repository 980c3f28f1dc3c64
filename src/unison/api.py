"""The programmatic API: plain functions with keyword arguments, what the CLI's commands also call.

    import unison
    from unison.config import TrainConfig

    summary = unison.train(TrainConfig(method="moco", epochs=10))        # -> Summary (rank 0's)
    backbone = unison.load_backbone("runs/default")                      # -> nn.Module, trained weights, eval mode
    scores = unison.evaluate("runs/default", knn_k=20, linear=False)     # -> dict: knn_top1, linear_top1, ...
    unison.embed("runs/default", "photos/", "photos.npy")                # features of every image, in input order
    unison.export("runs/default", "backbone.pt")                         # the backbone's state_dict + its .json
    report = unison.check("simclr", world_size=2)                        # -> CheckReport

    # your own pieces in unison's loop (guide: "Bring your own model, data or loop"): module-level classes/functions
    summary = unison.train(cfg, backbone=MyNet(), feature_dim=512, dataset=MyPhotos(), transform=my_views)
    scores = unison.evaluate(summary.out, dataset=MyLabelled("train"), val=MyLabelled("val"))

`train` validates the configuration and checks the data, checkpoint and run directory before any worker
starts, then trains. A failure is a `unison.errors` exception with a one-line message.
`run` is a run directory (its latest checkpoint) or a checkpoint file, as ``--checkpoint`` takes it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from unison.config import TrainConfig
from unison.config.fields import did_you_mean, shown, type_error, unknown_keys_message
from unison.errors import ConfigError
from unison.training.summary import Summary

if TYPE_CHECKING:   # for annotations only: the check and eval packages are imported when first used
    import torch
    import torch.nn as nn

    from unison.equivalence.steps import CheckReport
    from unison.evaluation import EvalOptions

__all__ = ["check", "embed", "evaluate", "export", "load_backbone", "train"]

Run = str | os.PathLike[str]
F = TypeVar("F", bound=Callable[..., Any])


# ---- every API function's arguments, checked against its signature before it runs (`checked`: one rule for all)

# Types the annotations name that are not imported here (torch and the eval package load when first used). A value
# can only be an instance of a class whose module is loaded: a module not loaded means "not one".
_LAZY_TYPES = {"nn.Module": ("torch.nn", "Module", "an nn.Module"),
               "torch.device": ("torch", "device", "a torch.device"),
               "EvalOptions": ("unison.evaluation", "EvalOptions", "an EvalOptions (unison.evaluation)")}
_PLAIN_TYPES: dict[str, tuple[Any, str]] = {
    "str": (str, "a str"), "int": (int, "an int"), "float": ((int, float), "a number"),
    "bool": (bool, "a bool (True or False)"), "TrainConfig": (TrainConfig, "a TrainConfig (unison.config)")}


def _alternatives(annotation: str) -> list[str]:
    """The types of annotation text ``A | B[C | D] | None`` at its top level, with `Run` spelled out."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(annotation):
        depth += (c in "[(") - (c in "])")
        if c == "|" and depth == 0:
            parts.append(annotation[start:i].strip())
            start = i + 1
    parts.append(annotation[start:].strip())
    return [t for p in parts for t in (["str", "os.PathLike[str]"] if p == "Run" else [p])]


def _known(term: str) -> bool:
    return (term in ("Any", "None") or term.startswith(("os.PathLike", "Callable")) or term in _PLAIN_TYPES
            or term in _LAZY_TYPES)


def _accepts(term: str, value: Any) -> bool:
    if term == "Any":
        return True
    if term == "None":
        return value is None
    if term.startswith("os.PathLike"):
        return isinstance(value, os.PathLike)
    if term.startswith("Callable"):
        return callable(value)
    if term in _PLAIN_TYPES:   # a bool is no number here (``world_size=True``)
        return isinstance(value, _PLAIN_TYPES[term][0]) and (term == "bool" or not isinstance(value, bool))
    module, name, _ = _LAZY_TYPES[term]
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(value, getattr(loaded, name))


def _describe(terms: list[str]) -> str:
    path = "str" in terms and any(t.startswith("os.PathLike") for t in terms)
    words = ["a path (str or os.PathLike)"] if path else []
    for t in terms:
        if path and (t == "str" or t.startswith("os.PathLike")):
            continue
        words.append("None" if t == "None" else "a callable" if t.startswith("Callable") else "a path"
                     if t.startswith("os.PathLike") else _PLAIN_TYPES[t][1] if t in _PLAIN_TYPES else _LAZY_TYPES[t][2])
    return " or ".join(words)


def _hint(terms: list[str], value: Any) -> str:
    if "TrainConfig" in terms and isinstance(value, dict):
        return "; make one of the dict with TrainConfig.from_dict(d) (nested 'distributed' options too)"
    if "TrainConfig" in terms and value is None:
        return ", e.g. unison.train(TrainConfig(method='simclr'))"
    if "nn.Module" in terms and isinstance(value, str):   # `check` takes a name too (its annotation says str)
        return f"; a backbone by name is an option: TrainConfig(backbone={value[:40]!r})"
    return ""


def _call_error(what: str, sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any],
                exc: TypeError) -> str:
    """The one line for a call that does not bind to `sig`: an unknown keyword, too many positional arguments, ..."""
    params = sig.parameters
    names = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        return (f"{what}: unknown keyword argument {unknown[0]!r}{did_you_mean(unknown[0], names)}; it takes "
                f"{', '.join(names)}")
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):
        return (f"{what} takes {len(positional)} positional argument(s) ({', '.join(positional)}), given "
                f"{len(args)}; give the others by name ({', '.join(n for n in names if n not in positional)})")
    return f"{what}: {exc}"


def _check_options(what: str, values: dict[str, Any], cls: type, given: tuple[str, ...],
                   params: list[str]) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - set(given)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{what}: {unknown_keys_message(unknown, known | set(params))}")
    bad = type_error(values, cls)
    if bad is not None:
        name, value, typ = bad
        raise ConfigError(f"{what}: {name}={shown(value)} ({type(value).__name__}) must be "
                          f"{'an' if typ[:1] in 'aeiou' else 'a'} {typ}")


def checked(options: Callable[[], type] | None = None, given: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Decorate an API function: each call's arguments are checked against its signature before it runs, and a
    wrong one is a `ConfigError` naming the argument and what it takes (an unknown keyword with its closest name,
    a value of another type). `options`: the dataclass whose fields its ``**options`` are (``unison eval``'s
    `EvalOptions`, ...), imported when first called; `given`: the fields the function sets itself."""

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)
        terms = {n: _alternatives(p.annotation) for n, p in sig.parameters.items()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.annotation is not p.empty}
        unknown = [t for ts in terms.values() for t in ts if not _known(t)]
        if unknown:   # a developer's annotation this checker cannot read: fail at import, not at a user's call
            raise TypeError(f"unison.{fn.__name__}: annotation term {unknown[0]!r} is not one `checked` knows")
        what = f"unison.{fn.__name__}"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise ConfigError(_call_error(what, sig, args, kwargs, exc)) from None
            for name, value in bound.arguments.items():
                if name in terms and not any(_accepts(t, value) for t in terms[name]):
                    raise ConfigError(f"{what}: {name}={shown(value)} ({type(value).__name__}) must be "
                                      f"{_describe(terms[name])}{_hint(terms[name], value)}")
            extra = [v for n, v in bound.arguments.items() if sig.parameters[n].kind is inspect.Parameter.VAR_KEYWORD]
            if extra and extra[0] and options is not None:
                _check_options(what, extra[0], options(), given, list(terms))
            return fn(*args, **kwargs)

        call.__dict__["checked"] = True   # what the test of every public function looks for
        return call  # type: ignore[return-value]

    return wrap


def _check_spec() -> type:
    from unison.config.check import CheckSpec

    return CheckSpec


def _eval_options() -> type:
    from unison.evaluation import EvalOptions

    return EvalOptions


def _embed_options() -> type:
    from unison.embedding import EmbedOptions

    return EmbedOptions


@checked()
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


@checked(_check_spec, given=("method", "world_size"))
def check(method: str = "simclr", world_size: int = 2, *, backbone: nn.Module | str | None = None,
          feature_dim: int | None = None, dataset: Any = None, transform: Callable[[Any], Any] | None = None,
          **options: Any) -> CheckReport:
    """`unison check`: the training step at `world_size` workers against one process on the global batch;
    with your own `backbone` (and `feature_dim`), `dataset` and `transform` as `train` takes them, or a backbone by
    name (``backbone="resnet18"``, as ``unison check --backbone``). Other keywords: ``unison check``'s options.

    Example::

        assert unison.check("byol", world_size=2).passed
    """
    from unison.equivalence import run_equivalence
    from unison.training.pieces import OwnPieces

    if isinstance(backbone, str):   # a name, as --backbone
        options["backbone"], backbone = backbone, None
    own = OwnPieces(backbone, feature_dim, dataset, transform)
    return run_equivalence(method, world_size, own=own if own.given else None, **options)


@checked()
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


@checked(_eval_options, given=("checkpoint",))
def evaluate(run: Run | EvalOptions | None = None, *, dataset: Any = None, val: Any = None, backbone: nn.Module | None = None,
             **options: Any) -> dict[str, Any]:
    """`unison eval`: kNN, the linear probes and fine-tuning of `run`'s backbone (a run directory or checkpoint
    file). The keyword arguments are ``unison eval``'s options (``data``, ``val``, ``knn_k``, ``linear=False``,
    ``fine_tune=True``, ``labels="10%"``, ``from_scratch=True``, ``linear_protocol="standard"``, ``epochs``,
    ``world_size``, ...); an `EvalOptions` is taken as well, as `run`. Data default to the run's. Your own labelled
    data for kNN and the fast probe: `dataset` (reference images) and `val` (held-out images), ``Dataset`` objects
    of ``(image, label)`` items (or with a ``targets`` list); `backbone`: an instance for a run of your own
    backbone class that cannot be built without arguments. The result holds every score; ``result["report"]``
    the report's rows (protocol, labels, top-1, top-5, from scratch, gain), also written to ``RUN/eval/``.

    Example::

        unison.evaluate("runs/default")                                # the run's data: {"knn_top1": ..., ...}
        unison.evaluate("runs/a", data="photos/", val="held_out/", linear=False)
        unison.evaluate("runs/mine", dataset=ImageFolder("train/"), val=ImageFolder("val/"))
        r = unison.evaluate("runs/cifar", fine_tune=True, labels="1%", from_scratch=True, epochs=60)
        [(row["protocol"], row["top1"], row["gain_top1"]) for row in r["report"]]
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
        opts = EvalOptions(checkpoint=os.fspath(_path(run)), **options)
    return evaluate_checkpoint(opts, backbone=backbone, dataset=dataset, val=val)


@checked(_embed_options, given=("checkpoint", "data", "out"))
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
        return embed_images(EmbedOptions(checkpoint=os.fspath(_path(run)), data=data, out=os.fspath(out), **options))
    import csv

    import numpy as np

    with tempfile.TemporaryDirectory(prefix="unison-embed-") as tmp:
        r = embed_images(EmbedOptions(checkpoint=os.fspath(_path(run)), data=data,
                                      out=str(Path(tmp) / "features.npy"), **options))
        with open(r["names"], encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        features = np.load(r["out"])
    return {**{k: v for k, v in r.items() if k not in ("out", "names")}, "features": features,
            "files": [row["file"] for row in rows], "labels": [row["label"] for row in rows]}


@checked()
def export(run: Run, out: str | os.PathLike[str], *, format: str | None = None,
           overwrite: bool = False) -> dict[str, Any]:
    """`unison export`: `run`'s backbone as a plain state dict (``.pt``, or ``.safetensors``: `format` or the
    suffix of `out`) with its preprocessing beside it in ``<out>.json``; returns what was written. An existing
    `out` (or sidecar) is replaced only with `overwrite`.

    Example::

        info = unison.export("runs/default", "backbone.pt")
        net.load_state_dict(torch.load(info["path"]))
    """
    from unison.export import export_backbone

    return export_backbone(_path(run), os.fspath(out), format, overwrite=overwrite)


def _path(run: Run) -> Path:
    return Path(run)   # its type is checked by `checked`
