"""The one header every unison checkpoint carries, its validation, and reading it without the weights.

A ``.pt`` checkpoint is a dict whose first entries are the header; a ``.dcp`` directory keeps the
same dict (without the sharded tensors) in ``unison.pt``::

    {"format": "unison-checkpoint", "version": 1, "method": str, "step": int, "config": dict,
     "extra": dict, "unison_version": "0.1.0", ...}

Both kinds are built by `make_header` and checked by `check_header`, so they cannot drift apart. A checkpoint's
place is checked with its header (`check_placement`): a file named ``step_N`` holds step N, and a training run's
checkpoint in ``RUN/checkpoints/`` is one of the run in RUN (the run id its ``config.json`` records, since run ids
were recorded): a file renamed or copied in from another run would otherwise be continued as this run's, mixing the
two in one directory, and the next save of that step would replace it.
Files are always read with ``torch.load(weights_only=True)``: a checkpoint holds only tensors,
numbers, strings, bools, None, lists, tuples and dicts, and a file that would run code when
unpickled is refused, never executed.

`read_header` reads only what the CLI and the pre-flight checks need (method, step, config) of a
checkpoint file, a ``.dcp`` directory or a run directory: a ``.pt`` file is memory-mapped so its
tensors are not read, and of a ``.dcp`` directory only the small ``unison.pt`` is read (no model
is built, no shard is touched).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.data.files import read_regular
from unison.distributed import collectives as C
from unison.errors import CheckpointError
from unison.training.pieces import OWN
from unison.version import __version__

from .contents import MAX_STEP, check_fields, check_run_fields, shown
from .files import CHECKPOINT_DIR, DCP_HEADER, first_loadable, is_checkpoint_name, named_checkpoint, step_of
from .files import NO_CHECKPOINT_HINT as NO_CHECKPOINT_HINT  # re-exported: callers import it from here
from .safe_load import load_file, read_metadata_safely

if TYPE_CHECKING:
    from unison.training.step import Run

# What a checkpoint's tensors are the tensors of, beside its method: the configuration fields that name and shape
# them, with the option that sets each. A resume with another value would load nothing that fits.
STRUCTURE = {"backbone": "--backbone", "backbone_args": "--backbone-arg"}
# What decides the images of each step and their order (``distributed.`` fields under that key of the config): a
# resumed run keeps them. Another global batch, accumulation, seed or subset would continue from the same step
# number on another walk through the data (the rest of the epoch skipped or seen twice, the learning rate scaled to
# the new batch, the steps per epoch changed): refused, as another --time-budget is; a new run starts from the
# checkpoint's weights with --init.
KEPT = {"batch_size": "--batch-size", "distributed.grad_sync_every": "--grad-sync-every", "seed": "--seed",
        "subset": "--subset"}
Expected = str | Mapping[str, Any] | None   # a method name, or `structure(cfg)`
_MISSING = object()

FORMAT = "unison-checkpoint"
VERSION = 1
_ALLOWED = "tensors, numbers, strings, bools, None, lists, tuples and dicts"


# ------------------------------------------------------------------ building and validating
def make_header(state: dict[str, Any], step: int) -> dict[str, Any]:
    """`state` with the header first (it reads first in a debugger): format, version, method, step, config, extra,
    the version of unison that wrote it.

    The caller's "format"/"version" are overridden; "extra" (`ExtraState.collect()`) is {} when absent."""
    header = {"format": FORMAT, "version": VERSION, "method": state["method"], "step": step,
              "config": state["config"], "extra": state.get("extra") or {}, "unison_version": __version__}
    header.update((k, v) for k, v in state.items() if k not in header)
    return header


def run_header(run: Run, step: int, history: dict[str, Any], rng_states: list[Any],
               extra: dict[str, Any] | None) -> dict[str, Any]:
    """The header of a training run's checkpoint, ``.pt`` or ``.dcp`` alike: `make_header` plus the resolved
    recipe, the world size, every rank's RNG state (`rng_states`, gathered), the metric history and the
    extra state (`ExtraState.collect()`)."""
    return make_header({"method": run.cfg.method, "config": run.cfg.to_dict(), "extra": extra or {},
                        "resolved": run.resolved, "world_size": C.world_size(), "rng": rng_states,
                        "history": history}, step)


def _check_plain(obj: Any, where: str) -> None:
    """Raise unless `obj` holds only types that `torch.load(weights_only=True)` rebuilds."""
    if isinstance(obj, torch.Tensor) or obj is None or type(obj) in (bool, int, float, str):
        return
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if not (k is None or type(k) in (bool, int, float, str)):
                raise CheckpointError(
                    f"{where} has a key of type {type(k).__module__}.{type(k).__qualname__}; "
                    "checkpoint dict keys must be strings or numbers")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    # Caught here rather than at resume time, when the run is already lost.
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only "
        f"{_ALLOWED} (convert it, e.g. with float(), .tolist(), torch.as_tensor() or .to_dict())")


def validate_state(state: Any, step: Any, keep: Any) -> None:
    """Raise `CheckpointError` unless `state` can be saved as a checkpoint of `step` (keeping `keep`)."""
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"step must be an int from 0 to {MAX_STEP}, got {shown(step)}")
    if type(keep) is not int or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}")
    if not isinstance(state.get("method"), str) or not state["method"]:
        raise CheckpointError("state['method'] must be the method name (a non-empty str), e.g. 'moco'")
    if type(state.get("config")) not in (dict, OrderedDict):
        got = type(state["config"]).__name__ if "config" in state else "nothing"
        raise CheckpointError(f"state['config'] must be a plain dict (e.g. cfg.to_dict()), got {got}")
    if "step" in state and state["step"] != step:
        raise CheckpointError(f"state['step'] is {state['step']!r} but step={step}; drop it or make them agree")
    _check_plain(state, "state")


def structure(cfg: Any) -> dict[str, Any]:
    """What a checkpoint of a run with (validated) configuration `cfg` must agree on to be resumed by it: its
    method, `STRUCTURE` and `KEPT` (``expect_method=structure(cfg)``)."""
    kept = {name: _field(cfg.to_dict(), name) for name in KEPT}
    return {"method": cfg.method, **{name: getattr(cfg, name) for name in STRUCTURE}, **kept}


def _field(config: Mapping[str, Any], name: str) -> Any:
    """`config`'s value of `name` (``distributed.grad_sync_every``: under ``distributed``); `_MISSING` if none."""
    for part in name.split("."):
        if not isinstance(config, Mapping) or part not in config:
            return _MISSING
        config = config[part]
    return config


def _check_expected(ckpt: dict[str, Any], path: Path, expect: Expected) -> None:
    """Raise `CheckpointError` unless `ckpt` has the method (and the `STRUCTURE` fields) of `expect`."""
    expected = {"method": expect} if isinstance(expect, str) else dict(expect or {})
    method = expected.pop("method", None)
    if method is not None and ckpt["method"] != method:
        was = shown(ckpt["method"])
        raise CheckpointError(f"checkpoint {path} was written by method {was}, this run is '{method}'; "
                              f"use method {was} or a new run directory")
    config = ckpt.get("config") or {}
    for name, value in expected.items():
        if name in KEPT:
            _check_kept(config, path, name, value)
            continue
        if value is not None and config.get(name) is not None and config[name] != value:   # None: the recipe's
            flag = STRUCTURE.get(name, name)
            was, now = _as_options(flag, config[name]), _as_options(flag, value)
            if name == "backbone" and str(config[name]).startswith(OWN):   # `unison.train(..., backbone=...)`'s
                raise CheckpointError(f"checkpoint {path} was trained with your own backbone "
                                      f"{str(config[name])[len(OWN):]}, this run has {now}; pass the same backbone= "
                                      "(and feature_dim=) again to resume it, or a new --out to train anew")
            raise CheckpointError(f"checkpoint {path} was trained with {was}, this run has {now}; use {was} to "
                                  "resume it, or a new --out (without --resume) to train anew")


def _check_kept(config: Mapping[str, Any], path: Path, name: str, value: Any) -> None:
    """`KEPT` option `name`: the run's `value` must be the checkpoint's (one the checkpoint does not record: not
    compared)."""
    saved = _field(config, name)
    if saved is _MISSING or value is _MISSING or saved == value:
        return
    flag = KEPT[name]
    was, now = _as_options(flag, saved), _as_options(flag, value)
    raise CheckpointError(f"checkpoint {path} was trained with {was}, this run has {now}: a resumed run keeps the "
                          "images of each step and their order (the learning rate, the steps per epoch and the place "
                          f"in the epoch follow from them); resume with {was} (another --world-size splits the same "
                          f"batch), or start a new run from its weights: --init {path} --out NEW")


def _as_options(flag: str, value: Any) -> str:
    """`value` as the command line gives it (``--backbone small_cnn``, ``--backbone-arg depth=2``), bounded."""
    if value is None:
        return f"no {flag}"
    if isinstance(value, dict):
        items = [f"{flag} {shown(str(k), 40).strip(chr(39))}={shown(v, 40)}" for k, v in list(value.items())[:4]]
        return " ".join(items) + (" ..." if len(value) > 4 else "") if items else f"no {flag}"
    return f"{flag} {shown(value, 60).strip(chr(39))}"


def check_header(ckpt: Any, path: Path, expect_method: Expected, run: bool = False) -> None:
    """Raise `CheckpointError` unless `ckpt` (read from `path`) has a valid header (and method `expect_method`, or
    the method and model structure of `structure(cfg)`).

    `run`: a training run's checkpoint, whose config, history, RNG and extra state are checked too
    (`contents.check_run_fields`): what a resume, ``unison eval`` and ``unison export`` read."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        if isinstance(ckpt, dict):
            keys = ", ".join(shown(str(k), 30).strip("'\"") for k in list(ckpt)[:4]) + (", ..." if len(ckpt) > 4 else "")
            what = f"a dict with keys {keys}" if ckpt else "an empty dict"
        else:
            what = f"a {type(ckpt).__name__}"
        raise CheckpointError(
            f"{path} is not a unison checkpoint (it holds {what}, no '{FORMAT}' header); "
            "pass a file written by save_checkpoint, or load raw weights with torch.load")
    version = ckpt.get("version")
    if type(version) is not int or version < 1:
        raise CheckpointError(f"checkpoint {path} has an invalid format version {shown(version)}; the file is damaged")
    if version > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {shown(version)}, this unison reads up to {VERSION}; upgrade unison")
    check_fields(ckpt, path)
    if run:
        check_run_fields(ckpt, path)
    check_placement(ckpt, path, run)
    _check_expected(ckpt, path, expect_method)


def check_placement(ckpt: dict[str, Any], path: Path, run: bool) -> None:
    """Raise `CheckpointError` unless `ckpt` (its header checked) belongs where it lies: a ``step_N`` name is its
    step, and (`run`: a training run's checkpoint) one in ``RUN/checkpoints/`` is of the run in RUN, whose
    ``config.json`` records its run id (a run or a checkpoint from before run ids: not compared)."""
    step = ckpt["step"]
    if is_checkpoint_name(path) and step_of(path) != step:
        where = f", or move it out of {path.parent}" if path.parent.name == CHECKPOINT_DIR else ""
        raise CheckpointError(f"checkpoint {path} is named step {step_of(path)} but holds step {step} (its header): "
                              f"it was renamed, or copied in from another run; name it "
                              f"step_{step:08d}{path.suffix}{where}")
    if not run or path.parent.name != CHECKPOINT_DIR:
        return
    mine = (ckpt.get("resolved") or {}).get("run_id")
    run_dir = path.parent.parent
    recorded = _recorded_run(run_dir)
    theirs = recorded.get("run_id")
    if not isinstance(mine, str) or not isinstance(theirs, str) or mine == theirs:
        return
    seeds = (ckpt["config"].get("seed"), recorded.get("seed"))
    seed = (f", seed {shown(seeds[0])}", f", seed {shown(seeds[1])}") if seeds[0] != seeds[1] else ("", "")
    raise CheckpointError(f"checkpoint {path} is of another run (run id {mine}{seed[0]}) than the run in {run_dir} "
                          f"(run id {shown(theirs, 40).strip(chr(39))}{seed[1]}, its config.json): it was copied in; "
                          f"move it out of {path.parent} (to continue that run, --resume the file with a new --out)")


def _recorded_run(run_dir: Path) -> dict[str, Any]:
    """The run id and seed that ``RUN/config.json`` records ({} when it is missing, unreadable or not a run's)."""
    try:
        config = json.loads(read_regular(str(run_dir / "config.json"), limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(config, dict) or not isinstance(config.get("resolved"), dict):
        return {}
    return {"run_id": config["resolved"].get("run_id"), "seed": config.get("seed")}


# ------------------------------------------------------------------ header-only read
@dataclass(frozen=True)
class CheckpointHeader:
    """What a checkpoint says about itself: where it is, its method, step and the run's config."""

    path: Path
    method: str
    step: int
    config: dict[str, Any]
    version: int = VERSION
    resolved: dict[str, Any] | None = None   # the recipe values the run resolved (image size, data paths, ...)


def _read_one(path: Path, expect_method: Expected) -> CheckpointHeader:
    if path.is_dir():
        ckpt = load_file(path / DCP_HEADER, "cpu")
        check_header(ckpt, path, expect_method, run=True)
        read_metadata_safely(path)   # small; vets the shards' index (safe to unpickle, files present) up front
    else:
        ckpt = load_file(path, "cpu", mmap=True)   # mapped: the tensors are not read
        check_header(ckpt, path, expect_method, run=True)
    return CheckpointHeader(path, ckpt["method"], int(ckpt["step"]), dict(ckpt["config"]), int(ckpt["version"]),
                            dict(ckpt.get("resolved") or {}))


def read_header(path: str | Path, *, expect_method: Expected = None) -> CheckpointHeader:
    """The header of a training run's checkpoint file, ``.dcp`` directory, or the latest complete checkpoint of a
    run directory.

    Checks it as `load_checkpoint(run=True)` does (every field, `contents.check_run_fields`; the same errors, the
    same fallback past a corrupt latest file of a run directory) without reading the weights: what the CLI and the
    pre-flight checks need.
    """
    path = named_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; pass a checkpoint file or a run directory")
    if not path.is_dir() or is_checkpoint_name(path):
        return _read_one(path, expect_method)
    return first_loadable(path, lambda candidate: _read_one(candidate, expect_method))
