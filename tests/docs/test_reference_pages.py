"""The reference pages the docs build generates: the command-line reference from the CLI's own parsers (Markdown
tables: option, default, what it does), and the API reference's docstring examples as code blocks."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "check", "plan", "eval", "embed", "export", "plot", "bench")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = _script("cli_reference")


def _rows(markdown: str) -> dict[str, list[str]]:
    """The table rows of `markdown`, by the option they start with (``--epochs``, ``RUN``)."""
    rows = {}
    for line in markdown.splitlines():
        match = re.match(r'\| <code class="flag">([^< ]+)', line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip("|").split(" | ")]
    return rows


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_command_is_a_row_with_its_default(command):
    parser = REFERENCE.command_parser(command)
    if command == "bench":   # `bench all` takes every bench option; the reference says which parts read each
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["all"]
    page = REFERENCE.command_reference(command)
    rows = _rows(page)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = next((s for s in action.option_strings if s.startswith("--")), action.metavar or action.dest)
        assert name in rows, f"unison {command}: {name} has no row"
        assert "(default:" not in rows[name][2], rows[name]   # the default has its own column
    assert "|---|" in page and "unison-help" not in page


def test_defaults_are_read_from_the_help_as_it_states_them():
    rows = _rows(REFERENCE.command_reference("train"))
    assert rows["--epochs"][1] == "`30`" and rows["--method"][1] == "`simclr`"
    assert rows["--knn"][1] == "`on`" and rows["--stop-on-collapse"][1] == "`off`"
    assert rows["--lr"][1] == "method recipe" and "scaled linearly" in rows["--lr"][2]
    assert rows["--world-size"][1].startswith("one per visible GPU") and rows["--world-size"][2].endswith(")")
    assert "Methods and their hyper-parameters" in REFERENCE.command_reference("train")
    assert _rows(REFERENCE.command_reference("eval"))["--checkpoint"][1] == "required"
    assert _rows(REFERENCE.command_reference("plot"))["--x"][1] == "`auto`"


@pytest.mark.parametrize("text, expected", [
    ("training epochs (default: 30)", ("training epochs", "30")),
    ("sgd | lars; default: method recipe", ("sgd | lars", "method recipe")),
    ("worker processes (1 = one process; default: one per GPU, else 2)", ("worker processes (1 = one process)",
                                                                          "one per GPU, else 2")),
    ("crop size (a multiple of 8 (or 4))", ("crop size (a multiple of 8 (or 4))", None)),
])
def test_split_default(text, expected):
    assert REFERENCE.split_default(text) == expected


def test_table_cells_escape_what_markdown_would_read_otherwise():
    cell = REFERENCE.markdown_text("vit_<micro|nano> | timm:<name>, 3*H*W bytes, see `unison train` --no-knn")
    assert "&lt;micro\\|nano&gt;" in cell and "3\\*H\\*W" in cell and "`unison train`" in cell
    assert "`--no-knn`" in cell


LITERAL = _script("griffe_literal_blocks")


def test_a_literal_block_becomes_a_fenced_code_block():
    text = "Train a run.\n\nExample::\n\n    summary = unison.train(config)\n    print(summary)\n\nMore text."
    assert LITERAL.literal_blocks_to_fences(text) == (
        "Train a run.\n\nExample:\n\n```python\nsummary = unison.train(config)\nprint(summary)\n```\n\nMore text.")
    shell = LITERAL.literal_blocks_to_fences("Run it ::\n\n    unison train --epochs 3\n")
    assert shell == "Run it\n\n```bash\nunison train --epochs 3\n```"
    layout = LITERAL.literal_blocks_to_fences("Layout::\n\n    runs/a/\n      checkpoints/\n")
    assert layout.startswith("Layout:\n\n```text\nruns/a/\n  checkpoints/")


def test_the_public_api_docstrings_render_their_examples_as_code():
    griffe = pytest.importorskip("griffe")
    api = griffe.load("unison.api", search_paths=[str(ROOT / "src")],
                      extensions=griffe.load_extensions(LITERAL.LiteralBlocks))
    for name in ("train", "check", "evaluate", "embed", "export", "load_backbone"):
        text = api[name].docstring.value
        assert "::" not in text.replace("std::", ""), name
        assert "```python" in text, name
