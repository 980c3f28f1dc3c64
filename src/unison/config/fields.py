"""Generate argparse options from configuration dataclasses, so defaults live in one place.

Each dataclass field becomes ``--field-name`` (underscores to dashes, or ``metadata["flag"]``),
typed from its annotation, with its default and ``metadata["help"]`` shown in ``--help``.
Booleans get ``--x/--no-x``; ``metadata["required"]`` makes a flag required. Parsed options
that the user did not give stay absent from the namespace (``argparse.SUPPRESS``), so
`overrides_from_namespace` returns only what was typed and a YAML file plus CLI overrides
merge cleanly: defaults < config file < command line.

Numbers are read the way SSL recipes write them, from flags, YAML files and ``--param``
alike (`coerce_fields`): ``1e-3`` is a float (YAML 1.1 reads it as a string), and an
integer option takes an integral number in any notation (``--epochs 1e9``, ``1_000``).

Unknown keys get a "did you mean" (`unknown_keys_message`).
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import difflib
import math
import types
import typing
from collections.abc import Iterable
from typing import Any


def base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Optional[str]` -> str."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed (from __future__)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


_base_type = base_type   # the earlier private name


def parse_int(text: str) -> int:
    """An integer in any notation that is exactly integral: ``12``, ``1_000``, ``1e9``, ``2.0``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        d = decimal.Decimal(text.strip().replace("_", ""))
    except decimal.InvalidOperation:
        raise ValueError(text) from None
    if not d.is_finite() or d != d.to_integral_value():
        raise ValueError(text)
    return int(d)


parse_int.__name__ = "int"   # argparse names the type in its error: "invalid int value: 'ten'"


def coerce_value(value: Any, typ: Any) -> Any:
    """`value` converted to `typ` where the conversion is exact (numeric strings, integral floats); else as is.

    A value that does not convert is returned unchanged, so the type check that follows names it."""
    if typ is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if typ is int and not isinstance(value, bool):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return parse_int(value)
            except ValueError:
                return value
    return value


def coerce_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` (keys = fields of dataclass `cls`) with numbers coerced to the fields' types; nested
    dataclass fields are coerced recursively; unknown keys are left for the caller to refuse."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        if key not in hints or value is None:
            continue
        typ = base_type(hints[key])
        if isinstance(typ, type) and dataclasses.is_dataclass(typ) and isinstance(value, dict):
            out[key] = coerce_fields(typ, value)
        elif typ in (int, float):
            out[key] = coerce_value(value, typ)
    return out


def type_error(data: dict[str, Any], cls: type, kinds: tuple[type, ...] | None = None) -> tuple[str, Any, str] | None:
    """The first (name, value, type name) of `data` whose value is not of its field's type in `cls`; None if all fit.

    bool is not accepted for numbers, an int is accepted for a float; None always (it means "the default").
    `kinds`: check only fields of these types (e.g. numbers and booleans)."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in hints or value is None:
            continue
        typ = base_type(hints[key])
        typ = typing.get_origin(typ) or typ
        if dataclasses.is_dataclass(typ) or not isinstance(typ, type) or (kinds and typ not in kinds):
            continue
        ok = isinstance(value, (int, float) if typ is float else typ) and (typ is bool or not isinstance(value, bool))
        if not ok:
            return key, value, typ.__name__
    return None


def coerce_instance(obj: Any) -> None:
    """Coerce the int and float fields of dataclass instance `obj` in place (see `coerce_value`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ = base_type(hints[f.name])
        if typ in (int, float):
            setattr(obj, f.name, coerce_value(getattr(obj, f.name), typ))


def article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_keys_message(unknown: Iterable[str], known: Iterable[str], what: str = "option") -> str:
    """One line naming unknown keys, each with its closest known name, then every known name."""
    known = sorted(known)
    named = ", ".join(f"{u!r}{did_you_mean(u, known)}" for u in sorted(unknown))
    return f"unknown {what}(s) {named}; known: {', '.join(known)}"


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def help_text(f: dataclasses.Field, default: Any) -> str:
    """The field's help with its default, said once: a help text that names its own default ("default: method
    recipe") keeps it, and an unset default (None) or a required option shows none."""
    text = f.metadata.get("help", "")
    if default is None or "default:" in text or f.metadata.get("required"):
        return text
    return f"{text} (default: {default})"


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                            group_title: str | None = None) -> None:
    target = parser.add_argument_group(group_title) if group_title else parser
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        typ = base_type(f.type)
        if dataclasses.is_dataclass(typ) or typ in (dict, list) or typing.get_origin(typ) in (dict, list):
            continue
        default = getattr(defaults, f.name)
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text(f, default)}
        if f.metadata.get("required"):
            kwargs["required"] = True
        if typ is bool:
            target.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        kwargs["type"] = parse_int if typ is int else typ
        kwargs["metavar"] = f.metadata.get("metavar", typ.__name__.upper())
        target.add_argument(flag_name(f), **kwargs)


def overrides_from_namespace(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
