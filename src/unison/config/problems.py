"""Every problem of a config file at once: a user fixes the file in one pass, not one error per run.

`file_problems` reads the parsed mapping of a ``--config`` file (a `unison.config.files.Located` dict, which knows
the line of each key) and lists, key by key and in the order of the file,

* an option at the wrong level (``world_size:`` at the top, ``epochs:`` under ``distributed:``);
* an unknown option, with the closest known one (`unison.config.names`: ``learning_rate`` is ``lr``);
* a value of the wrong type, out of its field's range (``metadata["range"]``) or not one of its choices;
* a duration or a count of steps that is not one (``checkpoint_every: 2.5``), by the option's own parser;
* a YAML 1.1 base-60 number (``time_budget: 1:30``), with what to write instead.

`check_file` raises them as one `ConfigProblems`, which the CLI prints one line per problem. What depends on
several options together (a batch that the world size does not divide) or on the layers above (a method's name,
its hyper-parameters) is checked afterwards, by `TrainConfig.validate` and `unison.training.resolve`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from unison.config.budget import parse_duration
from unison.config.distributed import DistributedConfig
from unison.config.fields import NumberOutOfRange, Range, article, base_type, coerce_value, range_error, shown
from unison.config.files import Sexagesimal, sexagesimal_problem
from unison.config.names import closest
from unison.config.train import TrainConfig, checkpoint_cadence
from unison.errors import ConfigError, ConfigProblems

__all__ = ["check_file", "file_problems"]

_TAKES = {"checkpoint_every": "steps or duration", "time_budget": "duration"}   # beyond the numbers


def check_file(data: dict[str, Any], where: str) -> None:
    """Raise `ConfigProblems` naming `where` (``config file x.yaml``) when `data` has any `file_problems`."""
    problems = file_problems(data)
    if problems:
        raise ConfigProblems(where, problems)


def file_problems(data: dict[str, Any]) -> list[str]:
    """Every problem of the config-file mapping `data`, one line each, in the order of the file."""
    found: list[tuple[int, str]] = []
    top, dist = _fields(TrainConfig), _fields(DistributedConfig)
    lines = getattr(data, "lines", {})
    for key, value in data.items():
        at = lines.get(key, 0)
        if key == "distributed":
            if value is not None and not isinstance(value, dict):
                found.append((at, f"distributed must be a mapping of distributed options, got {shown(value)} "
                                  "(e.g. distributed: {world_size: 2})"))
            elif value:
                inner = getattr(value, "lines", {})
                found += [(inner.get(k, at), p) for k, v in value.items()
                          for p in _key_problems(k, v, dist, top, "distributed.")]
            continue
        found += [(at, p) for p in _key_problems(key, value, top, dist, "")]
    found.sort(key=lambda item: item[0])
    return [f"line {at}: {text}" if at else text for at, text in found]


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _key_problems(key: Any, value: Any, here: dict[str, Any], other: dict[str, Any], prefix: str) -> list[str]:
    """The problems of ``key: value`` at one level (`here`: its options; `other`: the other level's)."""
    if not isinstance(key, str):
        return [f"{shown(key)} is not an option name"]
    if key in here:
        problem = _value_problem(prefix + key, value, *here[key])
        return [problem] if problem else []
    if key in other:
        if prefix:
            return [f"{prefix}{key}: {key} belongs at the top level of a config file, not under 'distributed:'"]
        return [f"{key} belongs under 'distributed:' in a config file (distributed: {{{key}: {shown(value)}}}); "
                f"on the command line: --{key.replace('_', '-')}"]
    near = closest(key, here)
    near_other = closest(key, other) if near is None else None
    what = "distributed option" if prefix else "option"
    hint = (f" (did you mean {near!r}?)" if near else
            f" (did you mean {near_other!r}, {'at the top level' if prefix else 'under distributed:'}?)"
            if near_other else "; `unison train --help` lists the options")
    return [f"{prefix}{key} is not a{'n' if what[0] == 'o' else ''} {what}{hint}"]


def _value_problem(name: str, value: Any, f: dataclasses.Field, hint: Any) -> str | None:
    """What is wrong with `value` for the field `f` (type `hint`) alone, or None."""
    typ = base_type(hint)
    takes = _TAKES.get(f.name) or ("number" if typ in (int, float) else None)
    if isinstance(value, Sexagesimal) and takes:
        return sexagesimal_problem(name, value, takes)
    if value is None:
        return None if type(None) in typing.get_args(hint) else f"{name} is empty; give a value or leave it out"
    try:
        if f.name == "checkpoint_every":
            checkpoint_cadence(value)
            return None
        if f.name == "time_budget":
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                return f"{name}={shown(value)} must be a duration such as 90s, 10m, 2h or 1h30m"
            parse_duration(str(value))
            return None
    except ConfigError as exc:
        return str(exc)
    origin = typing.get_origin(typ) or typ
    if dataclasses.is_dataclass(origin) or not isinstance(origin, type):
        return None
    if origin is dict:
        return None if isinstance(value, dict) else f"{name} must be a mapping of names to values, got {shown(value)}"
    try:
        value = coerce_value(value, origin)
    except NumberOutOfRange:
        rng = f.metadata.get("range")
        return f"{name}={shown(value)} is out of range: give {rng.describe(origin is int) if rng else 'a smaller number'}"
    kinds: tuple[type, ...] = (int, float) if origin is float else (str,) if origin is str else (origin,)
    if not isinstance(value, kinds) or (origin is not bool and isinstance(value, bool)):
        return f"{name}={shown(value)} must be {article(origin.__name__)} {origin.__name__}"
    rng = f.metadata.get("range")
    if isinstance(rng, Range) and origin in (int, float):
        return range_error(name, value, rng, origin is int)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        near = closest(str(value), [str(c) for c in choices])
        return (f"{name}={shown(value)} is unknown{f' (did you mean {near!r}?)' if near else ''}; use one of "
                f"{', '.join(map(str, choices))}")
    return None
