"""The command-line reference as Markdown, generated from the parsers `unison.cli.make_parser` builds (the options of
`train`, `check` and `plan` are generated from the configuration dataclasses by `unison.config.fields`), so the
page cannot drift from ``unison COMMAND --help``. The docs build calls it (`scripts/mkdocs_hooks.py` replaces
``<!-- unison-help: COMMAND -->`` with `command_reference(COMMAND)`).

Each command becomes its description and one table per group of ``--help`` (option, default, what it does):
tables that wrap in the page, where ``--help``'s fixed-width text would need a horizontal scrollbar. The default
is taken from the help text, where `unison.config.fields.help_text` writes it (``(default: X)``, or the text's own
``; default: ...``), else from the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import re
import sys

OPTION = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9-]*)")   # a flag in prose: shown as code


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of `unison COMMAND` (bench: of ``unison bench all``, which takes every bench option)."""
    from unison.cli import make_parser

    sub = _subparsers(make_parser(command))
    if command not in sub.choices:
        raise KeyError(command)
    return sub.choices[command]


def _depth_zero(text: str, needle: str, depth_wanted: int = 0) -> list[int]:
    """Where `needle` starts in `text` at parenthesis depth `depth_wanted`."""
    found, depth = [], 0
    for i, c in enumerate(text):
        if text.startswith(needle, i) and depth == depth_wanted:
            found.append(i)
        depth += (c == "(") - (c == ")")
    return found


def split_default(text: str) -> tuple[str, str | None]:
    """(what the option does, its default) from a help text that states its default, else (text, None)."""
    text = " ".join(text.split())
    trailing = re.search(r"\s*\(default:? ", text)
    if trailing and text.endswith(")") and _depth_zero(text, trailing.group(0).lstrip()) \
            and _balanced_tail(text, trailing.start()):
        return text[:trailing.start()].rstrip(" ;,"), text[trailing.end():-1]
    at_top = _depth_zero(text, "; default: ")
    if at_top:
        i = at_top[-1]
        return text[:i], text[i + len("; default: "):]
    if text.startswith("default: "):
        return "", text[len("default: "):]
    inner = _depth_zero(text, "; default: ", 1)
    if inner and text.endswith(")"):
        i = inner[-1]
        return text[:i] + ")", text[i + len("; default: "):-1]
    return text, None


def _balanced_tail(text: str, start: int) -> bool:
    """Whether text[start:] is one parenthesised group that closes at the end of `text`."""
    depth = 0
    for i, c in enumerate(text[start:], start):
        depth += (c == "(") - (c == ")")
        if depth == 0 and c == ")":
            return i == len(text) - 1
    return False


def markdown_text(text: str) -> str:
    """Plain help text as Markdown inline text for a table cell: flags as code, the rest escaped (``<name>``,
    ``3*H*W`` and ``a | b`` read as written); what is already in backquotes is kept as code."""
    parts = re.split(r"(`[^`]*`)", text.replace(sys.executable, "python"))
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
            continue
        part = html.escape(part, quote=False).replace("*", r"\*").replace("|", r"\|").replace("_", r"\_")
        out.append(OPTION.sub(lambda m: f"`{m.group(1)}`", part))
    return "".join(out)


def _flag(text: str) -> str:
    """An option as the first column shows it: code that does not break inside the flag."""
    return f'<code class="flag">{html.escape(text, quote=False)}</code>'


def _option_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return _flag(action.metavar or action.dest)
    names = [s for s in action.option_strings if s.startswith("--")] or action.option_strings
    if isinstance(action, argparse.BooleanOptionalAction):
        return "<br>".join(_flag(name) for name in names)
    if action.nargs == 0:
        return _flag(names[0])
    metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                 else action.dest.upper())
    return _flag(f"{names[0]} {metavar}")


def _default_cell(action: argparse.Action, stated: str | None) -> str:
    if action.required:
        return "required"
    if stated is not None:
        value = stated
    elif action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._AppendAction):
        return ""
    else:
        value = action.default
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        value = {"True": "on", "False": "off"}.get(str(value), value)
    return f"`{value}`" if re.fullmatch(r"[\w.,:/+-]+", str(value)) else markdown_text(str(value))


def options_table(actions: list[argparse.Action]) -> str:
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        formatter = argparse.HelpFormatter("unison")
        what, stated = split_default(formatter._expand_help(action) if action.help else "")
        rows.append(f"| {_option_cell(action)} | {_default_cell(action, stated)} | {markdown_text(what)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(title, table) of each group of `parser`'s ``--help`` that has options, in its order."""
    found = []
    for group in parser._action_groups:
        table = options_table(group._group_actions)
        if table:
            title = {"options": "Options", "positional arguments": "Arguments"}.get(group.title or "", group.title)
            title = title or "Options"
            found.append((title[0].upper() + title[1:], table))
    return found


def _description(parser: argparse.ArgumentParser) -> str:
    paragraphs = re.split(r"\n\s*\n", parser.description or "")
    return "\n\n".join(markdown_text(" ".join(p.split())) for p in paragraphs if p.strip())


def command_reference(command: str, heading: str = "###") -> str:
    """The Markdown reference of `unison COMMAND`: its description, then a table per option group (and, for
    ``train``, the methods with their hyper-parameters, the augmentation presets and the backbones)."""
    if command == "bench":
        return bench_reference(heading)
    parser = command_parser(command)
    blocks = [_description(parser)]
    for title, table in _groups(parser):
        blocks += [f"{heading} {title}", table]
    if command == "train":
        blocks += train_lists(heading)
    return "\n\n".join(b for b in blocks if b) + "\n"


def commands_table() -> str:
    """`unison --help`'s list of commands, as a table."""
    from unison.cli import make_parser

    sub = _subparsers(make_parser(""))
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| [`unison {a.dest}`](#unison-{a.dest}) | {markdown_text(a.help or '')} |" for a in sub._choices_actions]
    return "\n".join(rows) + "\n"


def train_lists(heading: str) -> list[str]:
    """The lists `unison train --help` ends with (`unison.cli.train_args.train_epilog`), as Markdown."""
    from unison.cli.train_args import epilog_lists

    methods, presets, backbones = epilog_lists()
    rows = ["| `--method` | hyper-parameters (`--param NAME=VALUE`) and their defaults |", "|---|---|"]
    for name, params in methods:
        shown = ", ".join(f"`{key}={value}`" for key, value in params)
        rows.append(f"| `{name}` | {shown} |")
    return [f"{heading} Methods and their hyper-parameters", "\n".join(rows),
            f"{heading} Augmentation presets and backbones",
            "`--augmentation` (default: the method's recipe): " + ", ".join(f"`{p}`" for p in presets) + ".\n\n"
            "`--backbone`: " + ", ".join(f"`{b}`" for b in backbones)
            + ", and `timm:<model>` (settings with `--backbone-arg NAME=VALUE`)."]


def bench_reference(heading: str = "###") -> str:
    """``unison bench``: its parts, then one table of every option with the parts that read it."""
    from unison.bench.commands import config_class, part_options
    from unison.bench.lab import find_lab

    lab = find_lab()   # the lab's parts (lightly, race) and their options: this script runs from the repository
    options = part_options(lab)
    bench = command_parser("bench")
    parts = _subparsers(bench)
    rows = ["| part | what it measures |", "|---|---|"]
    for name, part in parts.choices.items():
        rows.append(f"| `unison bench {name}` | {_description(part)} |")
    all_fields = [f.name for f in dataclasses.fields(config_class(lab))]
    readers = {f: [p for p, opts in options.items() if f in opts] for f in all_fields}
    table = options_table(parts.choices["all"]._actions).splitlines()
    table[0], table[1] = "| option | default | what it does | parts |", "|---|---|---|---|"
    by_dest = {a.dest: a for a in parts.choices["all"]._actions}
    shown = [a for a in parts.choices["all"]._actions
             if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]
    for i, action in enumerate(shown, 2):
        names = readers.get(action.dest, [])
        table[i] += " " + ("all" if len(names) == len(options) else ", ".join(names)) + " |"
    del by_dest
    return "\n\n".join([_description(bench), f"{heading} Parts", "\n".join(rows), f"{heading} Options",
                        "Each part takes the options it reads (`unison bench PART --help`); `unison bench all` "
                        "takes every option.", "\n".join(table)]) + "\n"
