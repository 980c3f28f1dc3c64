"""A griffe extension of the documentation site (mkdocs.yml names it): the docstrings' reST literal blocks become
Markdown code blocks.

unison's docstrings follow Python's own convention for code in a docstring, which ``help()`` shows as written: a
paragraph ending in ``::`` and an indented block (``Example::``). The API reference renders docstrings as Markdown,
which would show ``Example::`` as text, and the Google-style parser would take ``Example:`` for a section of its own.
So before the docstrings are parsed, each such block is rewritten as reST means it: the marker ``::`` becomes ``:``
(or nothing, when it stands alone or after a space) and the block a fenced code block, ``python`` when it parses as
Python, ``bash`` when it is commands, else ``text``. Docstrings stay as they are in the source.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

from griffe import Extension, Object

COMMANDS = re.compile(r"^(?:(?:unison|torchrun|srun|sbatch|mpirun|python|pip|bash)\s|\./|\$ )")   # a shell line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(block: str) -> str:
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if lines and all(COMMANDS.match(ln.lstrip()) for ln in lines):
        return "bash"
    try:
        ast.parse(block)
    except SyntaxError:
        return "text"
    return "python"


def literal_blocks_to_fences(text: str) -> str:
    """`text` with every reST literal block (a line ending in ``::``, then an indented block) as a fenced block."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if not line.rstrip().endswith("::") or j == i + 1 or j >= len(lines) or _indent(lines[j]) <= _indent(line):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        stripped = line.rstrip()
        if stripped.strip() != "::":   # "Example::" -> "Example:"; "text ::" -> "text"; a lone "::" goes
            out.append(stripped[:-3] if stripped.endswith(" ::") else stripped[:-1])
            out.append("")
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        block = textwrap.dedent("\n".join(lines[j:end]))
        pad = " " * base
        out += [f"{pad}```{_language(block)}", *(pad + ln if ln else "" for ln in block.splitlines()), f"{pad}```"]
        if end < len(lines):
            out.append("")
        i = end
        while i < len(lines) and not lines[i].strip():
            i += 1
    return "\n".join(out)


class LiteralBlocks(Extension):
    """Rewrites every loaded object's docstring once the object tree is complete, before it is parsed."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None and "::" in obj.docstring.value:
            obj.docstring.value = literal_blocks_to_fences(obj.docstring.value)
