"""The argument parser of every `unison` command: whole option names only, and a usage error is one line.

`Parser` is an `argparse.ArgumentParser` that

* takes no abbreviation (``allow_abbrev=False``, whatever a caller passes): ``--max-step 2`` is not silently
  ``--max-steps 2``, and an option added later cannot change what an abbreviation meant;
* answers a usage error with one line of its own command (``unison train: error: ...``), not the 40 lines of
  its usage above it, nor the top-level ``unison`` usage for a subcommand's option;
* suggests the closest option for a mistyped one and the closest choice for a mistyped value
  (`unison.config.names.closest`);
* keeps a renamed flag's earlier name working, with one line that names the new one (`DeprecatedAlias`).

Its subcommands' parsers are of the same class (argparse makes them of their parent's), so every command and
every part of ``unison bench`` parse alike. `error_prefix` set: a usage error raises `ConfigError` instead of
exiting (``bench --train-args`` parses ``unison train``'s flags and refuses them before any work).

It imports no torch: a mistyped option is answered at once.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from unison.config.names import closest
from unison.errors import ConfigError

__all__ = ["DeprecatedAlias", "Parser", "unrecognized"]

_PARSING: list[Parser] = []   # the parsers of the command line being parsed, outermost first


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` without abbreviations, with one-line errors and suggestions."""

    error_prefix: str | None = None   # set: a usage error raises ConfigError(error_prefix + message)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        _PARSING.append(self)   # a subcommand's parser is called by its parent's: the last one is the innermost
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """As argparse's, but arguments no parser took are reported by the innermost command's parser (which
        knows the options they were meant for), not by the top-level one."""
        del _PARSING[:]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            innermost = _PARSING[-1] if _PARSING else self
            innermost.error(unrecognized(extras, innermost))
        return ns

    def error(self, message: str) -> NoReturn:
        """One line: ``PROG: error: MESSAGE`` and exit code 2 (argparse's and unison's usage code)."""
        text = " ".join(message.split())
        if text.startswith("the following arguments are required"):   # a mistyped one may be why it is missing
            extras = self._unrecognized_without_required()
            text = unrecognized(extras, self) if extras else text
        if self.error_prefix is not None:
            raise ConfigError(f"{self.error_prefix}{text}")
        self.exit(2, f"{self.prog}: error: {text}\n")

    def _unrecognized_without_required(self) -> list[str]:
        """What this parser would not take of its arguments, were no option required (argparse checks the required
        ones first: ``--chekpoint x`` would be answered with "--checkpoint is required")."""
        required = [a for a in self._actions if a.required]
        for action in required:
            action.required = False
        try:
            probe = copy.copy(self)   # the same options; a bad value raises instead of exiting
            probe.exit_on_error = False
            return probe.parse_known_args(list(getattr(self, "_given", [])), argparse.Namespace())[1]
        except (argparse.ArgumentError, SystemExit):
            return []
        finally:
            for action in required:
                action.required = True

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value outside the choices names the closest one (``--amp bf61``: did you mean 'bf16'?)."""
        if action.choices is not None and value not in action.choices:
            choices = [str(c) for c in action.choices]
            close = closest(str(value), choices)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}; choose from {', '.join(choices)}")


class DeprecatedAlias(argparse.Action):
    """A flag's earlier name (``plot --replace`` for ``--overwrite``): it still sets `dest` to True, and says so in
    one warning line, naming the flag to use (``use``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, use: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.use = use

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: str | None = None) -> None:
        import warnings

        warnings.warn(f"{option} is deprecated: use {self.use} (the same flag in every command that writes a file)",
                      FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, True)


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The message for arguments `parser` did not take, with the closest option to each mistyped one."""
    flags = [s for s in parser._option_string_actions if s.startswith("--")]
    hints = []
    for word in extras:
        if not word.startswith("--"):
            continue
        given = word.split("=", 1)[0]
        close = closest(given[2:], [f[2:] for f in flags])
        if close is not None:
            hints.append((given, f"--{close}"))
    listed = " ".join(extras)
    listed = listed if len(listed) <= 200 else listed[:197] + "..."
    if len(hints) == 1 and len([w for w in extras if w.startswith("--")]) == 1:
        return f"unrecognized arguments: {listed} (did you mean {hints[0][1]}?)"
    if hints:
        return f"unrecognized arguments: {listed} ({'; '.join(f'{a}: did you mean {b}?' for a, b in hints)})"
    return f"unrecognized arguments: {listed}; `{parser.prog} --help` lists the options"
