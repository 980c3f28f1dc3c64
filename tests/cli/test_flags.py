"""The flags of every command: whole names only (no abbreviation is taken), and a usage error is one line of the
command's own, with the closest option or choice; no training starts."""

from __future__ import annotations

import argparse

import pytest

from unison.cli import SUBCOMMANDS, main, make_parser
from unison.config.parser import Parser

COMMANDS = ("train", "plan", "check", *(name for name, _, _ in SUBCOMMANDS))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _leaves() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """(the words that reach it, the parser) of every command and every part of `unison bench`."""
    found = []
    for command in COMMANDS:
        parser = _subparsers(make_parser(command))[command]
        parts = _subparsers(parser)
        found += [([command, part], p) for part, p in parts.items()] if parts else [([command], parser)]
    return found


LEAVES = _leaves()


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert len(err.splitlines()) == 1, err   # one line: no usage above it
    return err.strip()


def test_every_command_and_bench_part_parses_without_abbreviations():
    assert {" ".join(words) for words, _ in LEAVES} >= {"train", "plan", "check", "eval", "embed", "export", "plot",
                                                         "bench race", "bench table", "bench all"}
    for words, parser in LEAVES:
        assert isinstance(parser, Parser) and parser.allow_abbrev is False, words


@pytest.mark.parametrize("words, parser", LEAVES, ids=[" ".join(w) for w, _ in LEAVES])
def test_a_mistyped_flag_is_one_line_of_its_command_with_the_flag_meant(words, parser, capsys):
    """The command's longest option less its last letter: an abbreviation, refused, and suggested in full."""
    longest = max((s for s in parser._option_string_actions if s.startswith("--")), key=len)
    typo = longest[:-1]
    line = _usage_error([*words, typo, "1"], capsys)
    assert line.startswith(f"unison {' '.join(words)}: error: unrecognized arguments: {typo}"), line   # plot: 1 is a RUN
    assert line.endswith(f"(did you mean {longest}?)"), line


def test_a_flag_named_as_elsewhere_gets_unisons_name(capsys):
    line = _usage_error(["train", "--learning-rate", "0.1"], capsys)
    assert line == "unison train: error: unrecognized arguments: --learning-rate 0.1 (did you mean --lr?)"
    line = _usage_error(["eval", "--chekpoint", "runs/a"], capsys)   # not "--checkpoint is required"
    assert line == "unison eval: error: unrecognized arguments: --chekpoint runs/a (did you mean --checkpoint?)"


@pytest.mark.parametrize("command, given, meant", [
    ("eval", "--ckpt", "--checkpoint"), ("embed", "--ckpt", "--checkpoint"), ("train", "--ckpt", "--resume"),
    ("export", "--weights", "--checkpoint"), ("train", "--weights", "--init"), ("train", "--pretrained", "--init"),
])
def test_a_name_for_several_options_gets_the_one_this_command_has(command, given, meant, capsys):
    """``--ckpt`` is how other trainers name both the weights to read and the run to resume: each command is told
    its own option (``unison eval --ckpt`` was told ``--resume``, its flag to resume a fine-tuning)."""
    line = _usage_error([command, given, "runs/a"], capsys)
    assert line.endswith(f"unrecognized arguments: {given} runs/a (did you mean {meant}?)"), line


@pytest.mark.parametrize("argv, expected", [
    (["train", "--lr", "abc"], "unison train: error: argument --lr: invalid float value: 'abc'"),
    (["train", "--amp", "bf61"],
     "unison train: error: argument --amp: invalid choice: 'bf61' (did you mean 'bf16'?); choose from none, bf16, fp16"),
    (["trian"], "unison: error: argument command: invalid choice: 'trian' (did you mean 'train'?); choose from "
                "train, plan, check, eval, embed, export, plot, bench"),
    (["bench", "rase"], "unison bench: error: argument PART: invalid choice: 'rase' (did you mean 'race'?)"),
])
def test_a_bad_value_is_one_line_with_the_closest_choice(argv, expected, capsys):
    assert _usage_error(argv, capsys).startswith(expected)
