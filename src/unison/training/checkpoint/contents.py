"""Every value read from a checkpoint, type-checked and bounded before anything uses it: one place.

A checkpoint is a file from anywhere (another machine, another version, an edited copy), so nothing in it is
trusted: `check_fields` checks what every checkpoint's header holds (format version, method, step, config) and
`check_run_fields` what a training run's checkpoint adds (its config as a `TrainConfig`, world size, metric
history, resolved recipe, every rank's RNG state, extra state). Both are called by `header.check_header`, which
the pre-flight's header read (`read_header`, in the launching process), the workers' full load
(`load_checkpoint`, `resume_sharded`) and ``unison eval``/``export`` (`load_method`) all go through.
`check_optimizer_state` compares saved optimizer state with the optimizer it is about to be loaded into.

Every failure is one `CheckpointError` line naming the checkpoint and the field; strings from the file are
shown bounded (`shown`). Options this version does not know (a checkpoint of another version of unison) are not
damage: `drop_unknown_options` leaves them out with one warning that names them, and the rest is read.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from unison.config import DistributedConfig, TrainConfig
from unison.config.fields import article, count, type_error
from unison.config.train import LOGGERS
from unison.errors import CheckpointError, ConfigError
from unison.training.pieces import OWN
from unison.version import __version__

from .extra_state import extra_problem
from .files import warn_once
from .rng_state import rng_problem

MAX_STEP = 10**12        # optimiser steps: a million steps a day for 2700 years; past it a step count is damage
MAX_WORLD = 2**20        # workers that saved a checkpoint
MAX_NAME = 64            # a method name
MAX_TEXT = 4096          # any other string (paths, config values, history keys)
MAX_ITEMS = 10_000       # entries of a config, history or resolved-recipe container
_DICTS = (dict, OrderedDict)


def shown(value: Any, limit: int = 60) -> str:
    """`value` for a one-line message: its repr, cut to `limit` characters (a file's string may be huge)."""
    if type(value) is int and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"   # repr refuses past 4300 digits; no one reads them
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(path: Path, field: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} has an invalid {field} ({what}); the file is damaged or not "
                           "unison's: use another checkpoint")


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _plain_problem(obj: Any, where: str, depth: int = 0) -> str | None:
    """Strings bounded, containers bounded and not nested past 8 levels, keys strings: what a config holds."""
    if depth > 8:
        return f"{where} is nested too deeply"
    if isinstance(obj, str):
        return f"{where} is a string of {len(obj)} characters (at most {MAX_TEXT})" if len(obj) > MAX_TEXT else None
    if type(obj) in _DICTS or type(obj) in (list, tuple):
        if len(obj) > MAX_ITEMS:
            return f"{where} has {len(obj)} entries (at most {MAX_ITEMS})"
        items = obj.items() if type(obj) in _DICTS else enumerate(obj)
        for k, v in items:
            if type(obj) in _DICTS and not (isinstance(k, str) and len(k) <= MAX_NAME * 2):
                return f"{where} has the key {shown(k)}; keys must be short strings"
            problem = _plain_problem(v, f"{where}.{k}" if type(obj) in _DICTS else f"{where}[{k}]", depth + 1)
            if problem:
                return problem
    return None


# ------------------------------------------------------------------ every checkpoint
def check_fields(ckpt: dict[str, Any], path: Path) -> None:
    """The fields of every checkpoint's header after format and version: method, step, config."""
    method = ckpt.get("method")
    if not isinstance(method, str) or not 0 < len(method) <= MAX_NAME or not method.isprintable():
        raise _bad(path, "method", f"{shown(method)}; a method name such as 'simclr'")
    step = ckpt.get("step")
    if not _is_int(step, 0, MAX_STEP):
        raise _bad(path, "step", f"{shown(step)}; an integer from 0 to {MAX_STEP}")
    if type(ckpt.get("config")) not in _DICTS:
        raise _bad(path, "config", f"{type(ckpt.get('config')).__name__}; a dict of options")
    problem = _plain_problem(ckpt["config"], "config")
    if problem:
        raise _bad(path, "config", problem)


# ------------------------------------------------------------------ a training run's checkpoint
def check_run_fields(ckpt: dict[str, Any], path: Path) -> None:
    """What a training run's checkpoint adds to the header, checked as the run that reads it will use it."""
    drop_unknown_options(ckpt, path)
    _check_config(ckpt["config"], path)
    world = ckpt.get("world_size", 1)
    if not _is_int(world, 1, MAX_WORLD):
        raise _bad(path, "world_size", f"{shown(world)}; an integer from 1 to {MAX_WORLD}")
    _check_history(ckpt.get("history"), path)
    _check_resolved(ckpt.get("resolved"), ckpt["step"], path)
    rng = ckpt.get("rng")
    if rng is not None:
        if type(rng) not in (list, tuple) or len(rng) != world:
            raise _bad(path, "rng", f"{shown(rng)}; one RNG state per rank, {world} in all")
        for i, state in enumerate(rng):
            problem = rng_problem(state)
            if problem:
                raise _bad(path, f"rng[{i}]", problem)
    problem = extra_problem(ckpt.get("extra"))
    if problem:
        raise _bad(path, "extra state", problem)


def drop_unknown_options(ckpt: dict[str, Any], path: Path) -> None:
    """Options of the checkpoint's config that this version does not know (top level, ``distributed``, the method's
    parameters), left out of ``ckpt["config"]`` with one warning naming them: another version of unison wrote it
    (it records which, ``unison_version``, since this one), and every reader (a resume, ``unison eval``, ``export``)
    reads what this version knows of it. A config without ``method`` and ``distributed``, which every version's
    runs write, is no run's: it is left as it is (and refused as a run's by `_check_config`)."""
    from unison.methods import METHODS  # the registry: imported when a run is read

    config = dict(ckpt["config"])
    if "method" not in config or type(config.get("distributed")) not in _DICTS:   # not a run's config: not a version's
        return
    unknown = [str(k) for k in config if k not in _TRAIN_FIELDS]
    for k in unknown:
        del config[k]
    dist = config["distributed"]
    unknown += [f"distributed.{k}" for k in dist if k not in _DIST_FIELDS]
    config["distributed"] = {k: v for k, v in dist.items() if k in _DIST_FIELDS}
    params: Any = config.get("method_params")
    method = config.get("method")
    if type(params) in _DICTS and isinstance(method, str) and method in METHODS:
        names = {f.name for f in dataclasses.fields(METHODS[method].Params)}
        unknown += [f"method_params.{k}" for k in params if k not in names]
        config["method_params"] = {k: v for k, v in params.items() if k in names}
    if not unknown:
        return
    ckpt["config"] = config
    written = ckpt.get("unison_version")
    by = (f"unison {shown(written, 40).strip(chr(39))}" if isinstance(written, str) and written != __version__
          else "another version of unison")
    listed = ", ".join(shown(k, 60).strip("'") for k in unknown[:5]) + (f", ... ({len(unknown)} in all)"
                                                                        if len(unknown) > 5 else "")
    warn_once(f"checkpoint {path} was written by {by} (this is unison {__version__}), with option(s) this version "
              f"does not know: {listed}; they are left out and the rest of the checkpoint is read")


_TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
_DIST_FIELDS = frozenset(f.name for f in dataclasses.fields(DistributedConfig))


def _check_config(config: dict[str, Any], path: Path) -> None:
    """The stored config as a fresh `TrainConfig` is checked (`validate_run`), less what depends on this machine."""
    from unison.training.resolve import validate_run  # the method registry: imported when a run is read

    try:
        cfg = TrainConfig.from_dict(copy.deepcopy(dict(config)))
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "distributed"}
        bad = type_error(fields, TrainConfig)
        dist = cfg.distributed
        dist_bad = type_error({f.name: getattr(dist, f.name) for f in dataclasses.fields(dist)}, DistributedConfig)
        if bad or dist_bad:
            name, value, typ = bad or ("distributed." + dist_bad[0], dist_bad[1], dist_bad[2])  # type: ignore[index]
            raise ConfigError(f"{name} must be {article(typ)} {typ}, not {shown(value)}")
        if cfg.logger in LOGGERS:
            cfg.logger = "none"    # whether wandb is installed here is no fault of the file
        if str(cfg.backbone).startswith(OWN):   # the user's own backbone: checked when it is passed again
            cfg.backbone = None
        if cfg.teacher is not None:
            cfg.teacher = "random"   # nor whether distill's teacher file is here (the checkpoint holds the teacher)
        validate_run(cfg, cuda_available=True)   # nor whether this machine has GPUs
    except (ConfigError, TypeError, ValueError, AttributeError, KeyError) as e:
        text = str(e).replace("\n", " ")
        raise _bad(path, "config", text if len(text) <= 200 else text[:197] + "...") from None


def _check_history(history: Any, path: Path) -> None:
    """Metric history: names to numbers (or None, not measured)."""
    if history is None:
        return
    if type(history) not in _DICTS or len(history) > MAX_ITEMS:
        raise _bad(path, "history", f"{shown(history)}; a dict of metric names to numbers")
    for k, v in history.items():
        if not (isinstance(k, str) and len(k) <= MAX_NAME * 2) or not (v is None or _is_number(v)):
            raise _bad(path, "history", f"{shown(k)}: {shown(v)}; metric values are finite numbers or None")


def _check_resolved(resolved: Any, step: int, path: Path) -> None:
    """The recipe values the run used, those that are read back (by eval, export and the step bound)."""
    if resolved is None:
        return
    if type(resolved) not in _DICTS:
        raise _bad(path, "resolved", f"{shown(resolved)}; a dict of recipe values")
    problem = _plain_problem(resolved, "resolved")
    backbone = resolved.get("backbone")
    if not problem and backbone is not None and not (isinstance(backbone, str) and 0 < len(backbone) <= MAX_NAME * 2):
        problem = f"backbone {shown(backbone)} is not a backbone name"
    size = resolved.get("image_size")
    if not problem and size is not None and not _is_int(size, 1, 1 << 16):
        problem = f"image_size {shown(size)} is not an integer from 1 to 65536"
    for name in ("mean", "std"):
        v = resolved.get(name)
        if not problem and v is not None and not (type(v) in (list, tuple) and 1 <= len(v) <= 4
                                                  and all(_is_number(x) and abs(x) <= 1e6 for x in v)
                                                  and (name == "mean" or all(x > 0 for x in v))):
            problem = f"{name} is not a list of 1 to 4 numbers in [-1e6, 1e6]" + (", > 0" if name == "std" else "")
    run_id = resolved.get("run_id")
    if not problem and run_id is not None and not (isinstance(run_id, str) and 0 < len(run_id) <= MAX_NAME
                                                   and run_id.isalnum() and run_id.isascii()):
        problem = f"run_id {shown(run_id)} is not a run id (letters and digits)"
    total = resolved.get("total_steps")
    if not problem and total is not None and not _is_int(total, 0, MAX_STEP):
        problem = f"total_steps {shown(total)} is not an integer from 0 to {MAX_STEP}"
    if not problem and total is not None and step > total:
        raise _bad(path, "step", f"{step} is past the {count(total, 'step')} of the run that saved it")
    if problem:
        raise _bad(path, "resolved recipe", problem)


def check_step_in_run(step: int, total_steps: int, path: str | Path) -> None:
    """A checkpoint's step must lie within the run that resumes it (else the run would just 'finish' there)."""
    if step > total_steps:
        raise CheckpointError(f"checkpoint {path} is at step {step}, past the {count(total_steps, 'step')} of this run; "
                              "give more --epochs (or a larger --max-steps) to train on, or resume another "
                              "checkpoint")


# ------------------------------------------------------------------ optimizer state
SCALAR_STATE = frozenset({"step"})   # the per-parameter state of unison's optimizers that is one number


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, path: str | Path) -> None:
    """Raise unless `state` (a full ``optimizer.state_dict()``) fits `optimizer`: groups, parameters, shapes."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} has optimizer state that does not fit this run's optimizer "
                               f"({what}); resume with the options it was saved with, or start a new run")

    if state is None:
        raise bad("the checkpoint holds none")
    if type(state) not in _DICTS or type(state.get("state")) not in _DICTS \
            or type(state.get("param_groups")) not in (list, tuple):
        raise bad("not a dict with 'state' and 'param_groups'")
    groups, saved_groups = optimizer.param_groups, state["param_groups"]
    if len(saved_groups) != len(groups):
        raise bad(f"{len(saved_groups)} parameter group(s), the optimizer has {len(groups)}")
    params: dict[int, torch.Tensor] = {}
    for g, (group, saved) in enumerate(zip(groups, saved_groups)):
        if type(saved) not in _DICTS or type(saved.get("params")) not in (list, tuple):
            raise bad(f"parameter group {g} is {shown(saved)}")
        if len(saved["params"]) != len(group["params"]) or not all(type(i) is int for i in saved["params"]):
            raise bad(f"parameter group {g} has {len(saved['params'])} parameter(s), the optimizer "
                      f"{len(group['params'])}")
        if any(i in params for i in saved["params"]) or len(set(saved["params"])) != len(saved["params"]):
            raise bad(f"parameter group {g} names a parameter twice")
        params.update(zip(saved["params"], group["params"]))
        for key, value in saved.items():
            if key != "params" and key in group and not _same_kind(value, group[key]):
                raise bad(f"parameter group {g}: {key}={shown(value)}, expected a value like {shown(group[key])}")
    for i, entry in state["state"].items():
        if i not in params or type(entry) not in _DICTS:
            raise bad(f"state of an unknown parameter {shown(i)}")
        for name, value in entry.items():
            problem = _state_problem(name, value, params[i])
            if problem:
                raise bad(f"parameter {i} {shown(name)}: {problem}")


def _same_kind(value: Any, like: Any) -> bool:
    """A hyper-parameter of the type the optimizer uses (numbers finite); None/bool flags interchange."""
    if like is None or type(like) is bool:
        return value is None or type(value) is bool
    if type(like) in (int, float):
        return _is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    if type(like) in (list, tuple):
        return type(value) in (list, tuple) and len(value) == len(like) and all(map(_same_kind, value, like))
    if isinstance(like, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == like.shape
    return type(value) is type(like)


def _state_problem(name: Any, value: Any, param: torch.Tensor) -> str | None:
    if isinstance(value, torch.Tensor):
        # the one scalar (Adam's step) is 0-d; any other state is per element of the parameter, of its shape (a
        # [1] or 0-d momentum buffer of a [32, 3, 3, 3] weight: the update would fail to broadcast into it)
        if name in SCALAR_STATE and value.dim() == 0:
            return None if math.isfinite(float(value)) or not value.is_floating_point() else "not finite"
        if value.shape != param.shape:
            return f"shape {tuple(value.shape)}, the parameter has {tuple(param.shape)}"
        if value.is_floating_point() != param.is_floating_point() or value.is_complex() != param.is_complex():
            return f"dtype {value.dtype}, the parameter has {param.dtype}"
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return "NaN or infinite values (the next step would make the weights NaN)"
        return None
    return None if value is None or _is_number(value) or type(value) is bool else f"{shown(value)} is not a number"
