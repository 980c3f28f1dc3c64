"""Configuration files and values as text: read as bounded regular files, parsed by a strict YAML loader.

`read_regular_file` refuses what is not a regular file (a directory, /dev/null, a FIFO that would block) and
anything past a size bound, before reading; `decode_utf8` turns bytes that are not UTF-8 into one line.
`load_yaml_text` parses with `StrictLoader`: YAML's safe subset (a value never constructs a Python object), and
on top of it

* aliases (``*name``) are refused: a few lines of anchors and aliases expand to gigabytes (an alias bomb);
* every mapping key is a string, and a key given twice is refused with both lines (PyYAML would let the last one
  win silently);
* an integer literal is at most `MAX_NUMBER_CHARS` characters (no 4300-digit ``ValueError``);
* a YAML 1.1 base-60 number (``1:30``, which YAML 1.1 reads as 90, and ``1:00`` as 60) is never a number: it is
  the text as written, a `Sexagesimal` (YAML 1.2 has no base-60 numbers, and a duration written as a clock
  would silently become another count of steps or seconds); `sexagesimal_problem` says how to write it instead,
  for every option that takes a number, steps or a duration;
* every mapping is a `Located` dict, which knows the line of each key, for messages that name where a problem is
  (`plain` turns the parsed value into plain dicts and strings once it is checked);
* nesting deeper than the parser's recursion is a one-line error.

Errors are `ConfigError` (exit code 2), one line with the position.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from unison.config.fields import MAX_NUMBER_CHARS, shown
from unison.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20   # 1 MiB: a config file of options is a few kB


def read_regular_file(path: str, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of regular file `path` (at most `max_bytes`); `ConfigError` naming `what` it is otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory; give a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what} {path} is a directory; give a YAML file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file (a device, pipe or socket); give a YAML file")
        if st.st_size > max_bytes:
            raise ConfigError(f"{what} {path} is {st.st_size} bytes, past the {max_bytes >> 10} KiB a config file "
                              "may have; is it the right file?")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:   # grew since the fstat
            raise ConfigError(f"{what} {path} is past the {max_bytes >> 10} KiB a config file may have")
        return data
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def decode_utf8(data: bytes, what: str) -> str:
    """`data` as UTF-8 text (a UTF-8 byte-order mark is dropped); `ConfigError` with the offending position."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(f"{what} is not UTF-8 text{hint}: byte {data[exc.start]:#04x} at line {line}; "
                          "save it as UTF-8") from None


class Sexagesimal(str):
    """A YAML 1.1 base-60 number as written (``1:30``); `number` is what YAML 1.1 would have read (90)."""

    @property
    def number(self) -> float:
        sign = -1 if self.startswith("-") else 1
        value = 0.0
        for part in self.lstrip("+-").replace("_", "").split(":"):
            value = value * 60 + float(part)
        return sign * value


class Located(dict):
    """A parsed YAML mapping that knows the line of each of its keys (`lines`)."""

    lines: dict[str, int]


def sexagesimal_problem(name: str, value: Sexagesimal, takes: str, sep: str = ": ") -> str:
    """Why ``name: value`` (a base-60 number) is refused, and what to write instead; `takes`: "duration",
    "steps or duration" or "number" (what the option takes); `sep`: how the name and a value are written (``=``
    for ``--param NAME=VALUE``)."""
    number = value.number
    n = f"{int(number)}" if float(number).is_integer() else f"{number:g}"
    head = f"{name}{sep}{value} is a base-60 number in YAML 1.1 ({n}), which unison does not read as a number"
    clock = _as_durations(value) or f'"{n}s"'
    if takes == "duration":
        return f"{head}: write the duration with units, quoted, e.g. {name}{sep}{clock}"
    if takes == "steps or duration":
        return f"{head}: write steps as a number ({name}{sep}{n}) or a duration with units, quoted ({name}{sep}{clock})"
    return f"{head}: write the number itself, e.g. {name}{sep}{n}"


def _as_durations(value: str) -> str:
    """``1:30`` as the durations it may mean, ``"1h30m" or "1m30s"``; ``1:00:30`` as ``"1h0m30s"``; '' otherwise."""
    parts = value.replace("_", "").split(":")
    if value.startswith(("-", "+")) or not all(p.isdigit() for p in parts):
        return ""
    numbers = [int(p) for p in parts]
    if len(numbers) == 3:
        return '"' + "".join(f"{x}{u}" for x, u in zip(numbers, "hms") if x) + '"'
    if len(numbers) != 2:
        return ""
    a, b = numbers
    return f'"{a}h{b}m" or "{a}m{b}s"' if b else f'"{a}h" or "{a}m"'


def plain(value: Any) -> Any:
    """`value` with every `Located` dict a dict and every `Sexagesimal` a str (what a configuration holds)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return str(value) if isinstance(value, Sexagesimal) else value


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` without aliases, with string keys given once, bounded integer literals and no base-60
    numbers; mappings are `Located`."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None,
                f"alias *{shown(event.anchor)} is not accepted in a config file or value: write the value out",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: dict[str, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown(key)} is not a name: option names are strings", key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown(key)} is given twice, at lines {seen[key]} and {line}; give it once",
                        key_node.start_mark)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> Any:
        text = self.construct_scalar(node)
        if len(str(text)) > MAX_NUMBER_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"the number {shown(text, 40)} has more than {MAX_NUMBER_CHARS} characters",
                node.start_mark)
        if ":" in str(text):
            return Sexagesimal(text)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Any) -> Any:
        text = self.construct_scalar(node)
        if ":" in str(text):
            return Sexagesimal(text)
        return super().construct_yaml_float(node)

    def construct_located_map(self, node: Any) -> Any:
        data = Located()
        data.lines = {}
        yield data
        data.update(self.construct_mapping(node))
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                data.lines.setdefault(key_node.value, key_node.start_mark.line + 1)


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_yaml_float)
StrictLoader.add_constructor("tag:yaml.org,2002:map", StrictLoader.construct_located_map)


def yaml_error(exc: Exception) -> str:
    """A YAML error as one line with its position: "line 2, column 5: expected ',' or ']' (while parsing ...)"."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} that starts at line {context_mark.line + 1})"
    return where + " ".join(str(problem).split())


def load_yaml_text(text: str) -> Any:
    """`text` parsed by `StrictLoader` (never a Python object); raises `yaml.YAMLError` (see `yaml_error`)."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (StrictLoader is a SafeLoader)
    except RecursionError:
        raise yaml.YAMLError("lists or mappings nested too deeply (a config value is a few levels deep)") from None
