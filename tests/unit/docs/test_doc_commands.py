"""Every `unison ...` command shown in a bash block of the README or of a documentation page parses with the CLI's
own parser (nothing runs): an option renamed or removed fails here, with the page and the command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]')")


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_documented_command_parses(page):
    refused = [(argv, why) for argv in HOOKS.unison_commands(page.read_text())
               if (why := HOOKS.check_command(argv)) is not None]
    assert not refused, refused


def test_the_readme_shows_commands_and_a_renamed_option_is_caught():
    assert len(HOOKS.unison_commands((ROOT / "README.md").read_text())) >= 5
    assert HOOKS.check_command(["train", "--method", "moco", "--world-size", "2"]) is None
    why = HOOKS.check_command(["train", "--no-such-option", "3"])
    assert why is not None and "--no-such-option" in why


def test_no_page_names_an_internal_issue_number():
    """Pages are for readers outside the repository: 'issue 25, item 3' means nothing to them (a peer's tracker,
    named with its project, e.g. 'torch issue 78549' or 'pytorch#135712', is a reference and stays)."""
    import re

    internal = re.compile(r"(?<!torch )(?<!pytorch )\bissues? \d+", re.I)
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)}" for page in PAGES
             for n, line in enumerate(page.read_text().splitlines(), 1) for m in internal.finditer(line)]
    assert not found, found
