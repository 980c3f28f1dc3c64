"""What the command line and ``help(unison)`` say about themselves: they speak to a user (what a command does, how
to start), not about the code's layers, its modules or the import system."""

from __future__ import annotations

import argparse
import pydoc
import re

import pytest

import unison
from unison.cli import make_parser

COMMANDS = ("train", "check", "plan", "eval", "embed", "export", "plot", "bench")
# A module path (unison.training.plots), a class of the code in backquotes (`CommMeter`), a private name, or
# words about the code's structure.
INTERNAL = re.compile(r"\bunison(\.[a-z_]+){2,}|`[A-Z][a-z]+[A-Z]\w*`|\b_[A-Z]\w+|\blayers? below\b|\bdispatch"
                      r"|\bimport system\b|\bproduction step\b|metered=True")


def _sub(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _texts():
    top = make_parser("")
    yield "unison", f"{top.description}\n{top.epilog}"
    yield from ((f"unison: {a.dest}", a.help) for a in _sub(top)._choices_actions)
    for command in COMMANDS:
        parser = _sub(make_parser(command)).choices[command]
        epilog = getattr(parser, "lazy_epilog", None)
        yield f"unison {command}", f"{parser.description}\n{epilog() if epilog else parser.epilog or ''}"
        if command == "bench":
            for part, sub in _sub(parser).choices.items():
                yield f"unison bench {part}", sub.description


@pytest.mark.parametrize("where, text", list(_texts()), ids=lambda v: v if v.startswith("unison") else "")
def test_descriptions_and_epilogs_name_no_internals(where, text):
    assert text and not INTERNAL.search(text), (where, INTERNAL.search(text))


def test_the_top_level_help_says_what_unison_does_and_how_to_start():
    text = make_parser("").format_help()
    assert "Self-supervised pre-training of image encoders" in text
    assert "unison train" in text and "unison COMMAND --help" in " ".join(text.split())


def test_help_of_the_package_shows_what_to_call_not_how_it_is_imported():
    text = pydoc.render_doc(unison, renderer=pydoc.plaintext)
    description = text.split("DESCRIPTION", 1)[1].split("PACKAGE CONTENTS", 1)[0]
    assert not INTERNAL.search(description), INTERNAL.search(description)
    for call in ("unison.train(", "unison.check(", "unison.evaluate(", "unison.embed(", "unison.export(",
                 "unison.load_backbone("):
        assert call in description, call
