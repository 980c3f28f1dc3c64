"""Generate argparse options from configuration dataclasses, so defaults live in one place.

Each dataclass field becomes ``--field-name`` (underscores to dashes, or ``metadata["flag"]``),
typed from its annotation, with its default and ``metadata["help"]`` shown in ``--help``.
Booleans get ``--x/--no-x``; ``metadata["required"]`` makes a flag required. Parsed options
that the user did not give stay absent from the namespace (``argparse.SUPPRESS``), so
`overrides_from_namespace` returns only what was typed and a YAML file plus CLI overrides
merge cleanly: defaults < config file < command line.

Numbers are read the way SSL recipes write them, from flags, YAML files and ``--param``
alike (`coerce_fields`): ``1e-3`` is a float (YAML 1.1 reads it as a string), and an
integer option takes an integral number in any notation (``--epochs 1e9``, ``1_000``). Every number is parsed
by `parse_int`/`parse_float`, bounded (64 characters, |n| <= 2**64), and every numeric field states its range in
``metadata["range"]`` (`Range`); `check_fields` is the one check of field values (coercion, type, range) that
`TrainConfig.validate` and `DistributedConfig.validate` run, in the pre-flight and in every worker. Values shown
in error messages go through `shown` (bounded in length and cost).

Unknown keys get a "did you mean" (`unison.config.names`).
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import math
import os
import reprlib
import types
import typing
from collections.abc import Iterable
from typing import Any

from unison.config.names import did_you_mean
from unison.errors import ConfigError


def base_type(annotation: Any) -> Any:
    """`int | None` -> int; `Optional[str]` -> str."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # annotations are postponed (from __future__)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


_base_type = base_type   # the private name, for code that still imports it


# Every number parsed anywhere (flags, YAML, --param, environment variables) goes through `parse_int` or
# `parse_float`: a number is at most this many characters and an integer at most 2**63-1 (a C long), so no
# input makes a 4300-digit ValueError or a 401-digit batch size; each field then checks its own range.
MAX_NUMBER_CHARS = 64
MAX_INT = 2**64   # past it no option means anything (a seed takes up to 2**64-1); each field's range is tighter


class NumberOutOfRange(ValueError):
    """A number that is well-formed but past what any option takes (|n| > 2**64, or too many characters)."""


def ascii_digits(text: str) -> bool:
    """`text` is a plain count, ASCII digits 0-9 only: the one test of unison's integer labels, block counts and
    environment counters (``str.isdigit`` also takes '²', which int() then refuses, and '٣', which it reads as 3)."""
    return bool(text) and text.isascii() and text.isdigit()


def parse_int(text: str) -> int:
    """An integer in any notation that is exactly integral: ``12``, ``1_000``, ``1e9``, ``2.0``; bounded.

    Raises `NumberOutOfRange` past 2**64 (or for text longer than `MAX_NUMBER_CHARS`), ValueError otherwise."""
    s = str(text).strip().replace("_", "")
    if len(s) > MAX_NUMBER_CHARS:
        raise NumberOutOfRange(text)
    try:
        value = int(s)
    except ValueError:
        try:
            d = decimal.Decimal(s)
        except decimal.InvalidOperation:
            raise ValueError(text) from None
        if not d.is_finite() or d != d.to_integral_value():
            raise ValueError(text) from None
        if d.adjusted() > 19:   # before int(): 1e5000000 would build a million-digit integer
            raise NumberOutOfRange(text) from None
        value = int(d)
    if abs(value) > MAX_INT:
        raise NumberOutOfRange(text)
    return value


def parse_float(text: str) -> float:
    """A float, from text of at most `MAX_NUMBER_CHARS` characters (``1e400`` is inf: the field's range refuses it)."""
    s = str(text).strip()
    if len(s) > MAX_NUMBER_CHARS:
        raise NumberOutOfRange(text)
    return float(s)


def _option_type(typ: type, rng: Range | None) -> Any:
    """The argparse type of a number option: bounded parsing, and a number past 2**64 refused with the field's
    range (argparse prints an `ArgumentTypeError` as it is: "argument --epochs: '1e5000' is out of range: ...")."""
    parse = parse_int if typ is int else parse_float

    def option(text: str) -> Any:
        try:
            return parse(text)
        except NumberOutOfRange:
            what = rng.describe(typ is int) if rng is not None else f"a number of at most {MAX_NUMBER_CHARS} characters"
            raise argparse.ArgumentTypeError(f"{shown(text)} is out of range: give {what}") from None

    option.__name__ = typ.__name__   # argparse names the type in its error: "invalid int value: 'ten'"
    return option


parse_int.__name__ = "int"


class _BoundedRepr(reprlib.Repr):
    """reprlib with a cut for every kind of value: an integer shows its size, not its 4300+ digits."""

    def repr_float(self, x: float, level: int) -> str:
        """``1e+15`` rather than ``1000000000000000.0`` (when exact), ``0.0`` stays ``0.0``."""
        r, g = repr(x), f"{x:g}"
        return g if len(r) > len(g) + 3 and float(g) == x else r

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() <= 200:
            return repr(x)
        return f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"


_REPR = _BoundedRepr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def shown(value: Any, limit: int = 100) -> str:
    """`repr(value)` bounded in length and cost (nesting, items, digits): every value an error message shows."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 step``, ``2 steps``: a number and its noun, as every message counts things."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def coerce_value(value: Any, typ: Any) -> Any:
    """`value` converted to `typ` where the conversion is exact (numeric strings, integral floats); else as is.

    A value that does not convert is returned unchanged, so the type check that follows names it; a number past
    any range raises `NumberOutOfRange`."""
    if typ is float and isinstance(value, str):
        try:
            return parse_float(value)
        except NumberOutOfRange:
            raise
        except ValueError:
            return value
    if typ is int and not isinstance(value, bool):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            if abs(value) > MAX_INT:
                raise NumberOutOfRange(value)
            return int(value)
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise NumberOutOfRange(value)
        if isinstance(value, str):
            try:
                return parse_int(value)
            except NumberOutOfRange:
                raise
            except ValueError:
                return value
    return value


def _coerce_field(cls: type, name: str, value: Any, typ: Any, prefix: str) -> Any:
    try:
        return coerce_value(value, typ)
    except NumberOutOfRange:
        spec = {f.name: f for f in dataclasses.fields(cls)}.get(name)
        rng = spec.metadata.get("range") if spec is not None else None
        what = rng.describe(typ is int) if isinstance(rng, Range) else f"a number below 2**64 in at most {MAX_NUMBER_CHARS} characters"
        raise ConfigError(f"{prefix}{name}={shown(value)} is out of range: give {what}") from None


def coerce_fields(cls: type, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A copy of `data` (keys = fields of dataclass `cls`) with numbers coerced to the fields' types; nested
    dataclass fields are coerced recursively; unknown keys are left for the caller to refuse. A number past any
    range (`parse_int`) is a `ConfigError` naming the field (`prefix` + name)."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        if key not in hints or value is None:
            continue
        typ = base_type(hints[key])
        if isinstance(typ, type) and dataclasses.is_dataclass(typ) and isinstance(value, dict):
            out[key] = coerce_fields(typ, value, f"{prefix}{key}.")
        elif typ in (int, float):
            out[key] = _coerce_field(cls, key, value, typ, prefix)
    return out


def type_error(data: dict[str, Any], cls: type, kinds: tuple[type, ...] | None = None) -> tuple[str, Any, str] | None:
    """The first (name, value, type name) of `data` whose value is not of its field's type in `cls`; None if all fit.

    bool is not accepted for numbers, an int is accepted for a float; None where the field is optional (it means
    "the default"; ``epochs:`` left empty in a YAML file is refused, not silently the default).
    `kinds`: check only fields of these types (e.g. numbers and booleans)."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in hints:
            continue
        typ = base_type(hints[key])
        typ = typing.get_origin(typ) or typ
        if dataclasses.is_dataclass(typ) or not isinstance(typ, type) or (kinds and typ not in kinds):
            continue
        if value is None:   # None means "the default" only where the default is None (`x: int | None`)
            if type(None) in typing.get_args(hints[key]):
                continue
            return key, value, typ.__name__
        kinds_ok = {float: (int, float), str: (str, os.PathLike)}.get(typ, typ)   # paths: the API takes Path
        if typ is str and int in typing.get_args(hints[key]):   # `int | str` (a count or a duration)
            kinds_ok = (int, str)
        ok = isinstance(value, kinds_ok) and (typ is bool or not isinstance(value, bool))
        if not ok:
            return key, value, typ.__name__
    return None


def coerce_instance(obj: Any, prefix: str = "") -> None:
    """Coerce the int and float fields of dataclass instance `obj` in place (see `coerce_value`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ = base_type(hints[f.name])
        if typ in (int, float) and getattr(obj, f.name) is not None:
            setattr(obj, f.name, _coerce_field(type(obj), f.name, getattr(obj, f.name), typ, prefix))


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric field's range (``metadata["range"]``), checked by `check_ranges`: ``lo``/``hi`` inclusive unless
    ``lo_open``/``hi_open``; a float must also be finite. ``above``: the message when the value is past ``hi``
    (instead of "must be <= hi"); ``hint``: said after every refusal; ``interval``: say "in [lo, hi]"."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    above: str = ""
    hint: str = ""
    interval: bool = False

    def below_lo(self, v: float) -> bool:
        return self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)

    def above_hi(self, v: float) -> bool:
        return self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a finite number"
        if self.interval and self.lo is not None and self.hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        parts = [f"{'>' if self.lo_open else '>='} {_num(self.lo)}"] if self.lo is not None else []
        parts += [f"{'<' if self.hi_open else '<='} {_num(self.hi)}"] if self.hi is not None else []
        return f"{kind} {' and '.join(parts)}".strip()


def _num(x: float) -> str:
    """A bound as a reader writes it: 65535, 1000000000, 2**62, 2**64-1, 0.5."""
    if isinstance(x, int) and x > 2**20:
        for k, text in ((x, ""), (x + 1, "-1")):
            if k & (k - 1) == 0:
                return f"2**{k.bit_length() - 1}{text}"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:.12g}"


def range_error(name: str, value: Any, rng: Range, integer: bool) -> str | None:
    """The refusal of `value` for a field of range `rng`, or None if it is inside."""
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if finite and not rng.below_lo(value) and not rng.above_hi(value):
        return None
    if finite and rng.above_hi(value) and rng.above:
        return f"{name}={shown(value)} {rng.above}"
    return f"{name}={shown(value)} must be {rng.describe(integer)}{rng.hint}"


def check_ranges(obj: Any, prefix: str = "") -> None:
    """Raise `ConfigError` for the first field of dataclass instance `obj` outside its ``metadata["range"]``
    (fields left at None mean "the default" and are not checked). The types are checked before (`type_error`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rng, value = f.metadata.get("range"), getattr(obj, f.name)
        if rng is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        error = range_error(prefix + f.name, value, rng, base_type(hints[f.name]) is int)
        if error:
            raise ConfigError(error)


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field of dataclass instance `obj` on its own: numbers coerced as recipes write them, then each value's
    type, then each number's range (``metadata["range"]``). The one check of field values, used by
    `TrainConfig.validate` and `DistributedConfig.validate` (the pre-flight and every worker)."""
    coerce_instance(obj, prefix)
    bad = type_error({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, type(obj))
    if bad:
        name, value, typ = bad
        raise ConfigError(f"{prefix}{name}={shown(value)} must be {article(typ)} {typ}")
    check_ranges(obj, prefix)


def article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def unknown_keys_message(unknown: Iterable[str], known: Iterable[str], what: str = "option") -> str:
    """One line naming unknown keys, each with its closest known name (`did_you_mean`), then every known name."""
    known = sorted(known)
    unknown = sorted(unknown, key=shown)
    named = ", ".join(f"{shown(u)}{did_you_mean(u, known)}" for u in unknown[:10])
    named += f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
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


def add_options_command(subparsers: Any, name: str, help: str, description: str, options: type,
                        func: Any) -> argparse.ArgumentParser:
    """A subcommand whose options are the fields of the dataclass `options` (eval, embed, export), run by `func`."""
    parser = subparsers.add_parser(name, help=help, description=description)
    add_dataclass_arguments(parser, options)
    parser.set_defaults(func=func)
    return parser


def _shown_default(f: dataclasses.Field) -> Any:
    """The default `--help` shows, read from the field without building the dataclass: a default that depends on the
    machine (the world size: one worker per GPU) is not computed for --help (no torch import), its help names it."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING or "default:" in f.metadata.get("help", ""):
        return None
    return f.default_factory()


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
                            group_title: str | None = None) -> None:
    target = parser.add_argument_group(group_title) if group_title else parser
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        typ = base_type(f.type)
        if dataclasses.is_dataclass(typ) or typ in (dict, list) or typing.get_origin(typ) in (dict, list):
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text(f, _shown_default(f))}
        if f.metadata.get("required"):
            kwargs["required"] = True
        if typ is bool:
            target.add_argument(flag_name(f), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        kwargs["type"] = _option_type(typ, f.metadata.get("range")) if typ in (int, float) else typ
        kwargs["metavar"] = f.metadata.get("metavar", typ.__name__.upper())
        target.add_argument(flag_name(f), **kwargs)


def overrides_from_namespace(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}
