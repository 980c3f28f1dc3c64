"""Generate argparse options from configuration dataclasses, so defaults live in one place.

Each dataclass field becomes ``--field-name`` (underscores to dashes, or ``metadata["flag"]``),
typed from its annotation, with its default and ``metadata["help"]`` shown in ``--help``.
Booleans get ``--x/--no-x``. Parsed options that the user did not give stay `None` in the
namespace (``argparse.SUPPRESS``), so `overrides_from_namespace` returns only what was typed
and a YAML file plus CLI overrides merge cleanly: defaults < config file < command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Optional[str]` -> str."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed (from __future__)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                            group_title: str | None = None) -> None:
    target = parser.add_argument_group(group_title) if group_title else parser
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        typ = _base_type(f.type)
        if dataclasses.is_dataclass(typ) or typ in (dict, list) or typing.get_origin(typ) in (dict, list):
            continue
        default = getattr(defaults, f.name)
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if typ is bool:
            target.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        kwargs["type"] = typ
        kwargs["metavar"] = f.metadata.get("metavar", typ.__name__.upper())
        target.add_argument(flag_name(f), **kwargs)


def overrides_from_namespace(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
