"""MkDocs hooks of unison's documentation site (mkdocs.yml names this file; `bash scripts/docs.sh` builds the site).

* ``<!-- unison-help: COMMAND -->`` in a page becomes that command's ``--help``, from the same parser the CLI
  builds from the configuration dataclasses, so the reference never drifts from ``unison COMMAND --help``.
* Links from a page into the repository outside ``docs/`` (``../examples/own_loop.py``, ``../tests/...``) are not
  pages of the site: each is checked to exist, and kept as the path in code type. A path that does not exist is
  an error, so the strict build fails on it as on a dead link between pages.
* Every ``unison ...`` command in a page's ``bash`` blocks is parsed by the CLI's parser (nothing runs): a command
  whose options no longer exist fails the build.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

from mkdocs.exceptions import PluginError

HELP = re.compile(r"<!--\s*unison-help:\s*([\w-]+)\s*-->")
LINK = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\[\]]*\])+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")   # text may hold [param]
BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


def command_help(command: str) -> str:
    """`unison COMMAND --help`, as the CLI prints it at 100 columns."""
    from unison.cli import make_parser

    os.environ["COLUMNS"] = "100"
    parser = make_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    if command not in sub.choices:
        raise PluginError(f"unison-help: no command {command!r}")
    return sub.choices[command].format_help()


def _help_block(match: re.Match[str]) -> str:
    return "```text\n" + command_help(match.group(1)) + "```\n"


def _repository_link(root: Path, docs: Path, page_path: Path, match: re.Match[str]) -> str:
    text, target = match.group(1), match.group(2)
    where = Path(os.path.normpath(page_path.parent / target))   # not resolve(): the tests build a linked copy
    if docs in where.parents:   # a page of the site: MkDocs itself checks it
        return match.group(0)
    if root not in where.parents or not where.exists():
        raise PluginError(f"{page_path.relative_to(docs)}: link to {target}, which is not in the repository")
    shown = where.relative_to(root).as_posix()
    return text if text.strip("`") == shown else f"{text} (`{shown}`)"


def unison_commands(markdown: str) -> list[list[str]]:
    """The `unison ...` commands of the page's bash blocks (continuation lines joined, comments dropped)."""
    commands = []
    for block in BASH_BLOCK.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True) if line.strip() else []
            if words[:1] == ["unison"] and len(words) > 1:
                commands.append(words[1:])
    return commands


def check_command(argv: list[str]) -> str | None:
    """Why the CLI's parser refuses `argv` (nothing runs), or None when it parses."""
    from unison.cli import make_parser

    if argv[0] in ("bench", "plot") or "--help" in argv:   # bench parts parse their own options when run
        return None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        make_parser(argv[0]).parse_args(argv)
        return None
    return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused"


def on_page_markdown(markdown: str, page, config, files) -> str:
    root, docs = Path(config.config_file_path).parent, Path(config.docs_dir)
    page_path = Path(os.path.normpath(page.file.abs_src_path))
    for argv in unison_commands(markdown):
        if (why := check_command(argv)) is not None:
            raise PluginError(f"{page.file.src_path}: `unison {shlex.join(argv)}` does not parse: {why}")
    markdown = HELP.sub(_help_block, markdown)
    return LINK.sub(lambda m: _repository_link(root, docs, page_path, m), markdown)
