"""Every `unison ...` command shown in a bash block of the README or of a documentation page parses with the CLI's
own parser (nothing runs): an option renamed or removed fails here, with the page and the command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _prose_paragraphs(markdown: str) -> list[list[str]]:
    """The words of each prose paragraph of a page (15 words or more): code blocks, tables, headings and the lines
    that name a figure's command (a backtick first, ``* command:``) left out, since those repeat by design."""
    import re

    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith(("|", "#", "`", "* command")):
            continue
        words = re.findall(r"[a-z0-9]+", block.lower())
        if len(words) >= 15:
            paragraphs.append(words)
    return paragraphs


def _shared(a: list[str], b: list[str]) -> float:
    """The share of the shorter paragraph's word pairs that the other has too (1.0: one says the other again)."""
    pa, pb = set(zip(a, a[1:])), set(zip(b, b[1:]))
    return len(pa & pb) / min(len(pa), len(pb))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_no_page_says_a_paragraph_twice(page):
    """The methods guide printed its opening paragraph twice, the second a reworded copy (on the site as well: the
    hooks add nothing to a page's prose). Pairs of paragraphs that share most of their word pairs are the same
    paragraph (more than 0.85 of them: two tables' shared one-line introductions stay below); the README and every
    page, as MkDocs renders them from these files."""
    import itertools

    paragraphs = _prose_paragraphs(page.read_text())
    twice = [(" ".join(a[:12]), round(_shared(a, b), 2)) for a, b in itertools.combinations(paragraphs, 2)
             if _shared(a, b) > 0.85]
    assert not twice, twice


def test_a_reworded_repeat_of_a_paragraph_is_caught():
    first = ("Every method's loss lives in `unison.losses` as `<Name>Loss`, with its formula and its distributed "
             "semantics in the docstring; every method passes `unison check` at W=2.")
    again = ("Every method's loss lives in `unison.losses` as `<Name>Loss` (reference), with its formula\nand its "
             "distributed semantics in the docstring; every method passes `unison check` at W=2 (float64).")
    other = ("Multi-crop local crops default to 3/7 of the image size, with a ViT rounded to a multiple of its patch "
             "size, so every method trains at its defaults.")
    a, b, c = _prose_paragraphs("\n\n".join([first, again, other]))
    assert _shared(a, b) > 0.85 > 0.6 > max(_shared(a, c), _shared(b, c))


def test_every_page_that_promises_the_same_mathematics_says_what_float32_gives():
    """ "Mathematically the same" read as "the same numbers": a float32 run at W=2 differs from W=1 by rounding
    (0.03 in the loss, 0.008 in kNN on the digits). Each paragraph that makes the promise says float32 agrees to
    rounding, or links to the section that measures it."""
    import re

    promised = 0
    for page in PAGES:
        for paragraph in re.split(r"\n\s*\n", page.read_text()):
            if re.search(r"mathematically (the same|equivalent)", paragraph, re.I):
                promised += 1
                assert "float32" in paragraph and "rounding" in paragraph, (page.name, paragraph[:300])
    assert promised >= 2   # the README and the start page; the exactness page measures it:
    assert "## float32: rounding, not a different run" in (ROOT / "docs" / "distributed.md").read_text()
