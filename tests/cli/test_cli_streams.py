"""What the CLI writes, when writing fails or the user presses Ctrl-C early: one line or a quiet exit code, never a
traceback. A full disk on standard output (``>/dev/full``) is ``unison: error: cannot write to standard output
(...)``, exit 1; a closed pipe (``| head -0``) exits 141 without a word; a broken standard error too, exit code only;
Ctrl-C before the command runs (torch importing) is ``unison: interrupted``, 130; warnings are one line."""

from __future__ import annotations

import argparse
import errno
import sys
import warnings

import pytest

import unison.cli
from unison.cli import main


class _Broken:
    """A stream every write or flush of which fails with `code`."""

    def __init__(self, code: int):
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, errno.errorcode[self.code] if self.code not in (errno.ENOSPC, errno.EPIPE) else
                      {errno.ENOSPC: "No space left on device", errno.EPIPE: "Broken pipe"}[self.code])

    flush = write


@pytest.mark.parametrize("code, expected, line", [
    (errno.ENOSPC, 1, "unison: error: cannot write to standard output (No space left on device)\n"),
    (errno.EPIPE, 141, ""),
], ids=["enospc", "epipe"])
def test_a_failed_write_to_standard_output(code, expected, line, monkeypatch, capfd):
    monkeypatch.setattr(sys, "stdout", _Broken(code))
    assert main(["--version"]) == expected   # was an OSError traceback
    assert capfd.readouterr().err == line


def test_a_broken_standard_error_is_an_exit_code(monkeypatch, capfd):
    monkeypatch.setattr(sys, "stdout", _Broken(errno.ENOSPC))
    monkeypatch.setattr(sys, "stderr", _Broken(errno.ENOSPC))
    assert main(["--version"]) == 1


def test_ctrl_c_before_the_command_runs(monkeypatch, capfd):
    def interrupted(command=None):
        raise KeyboardInterrupt   # as while torch imports (the command's module imports it)

    monkeypatch.setattr(unison.cli, "make_parser", interrupted)
    assert main(["eval"]) == 130   # was a 30-line KeyboardInterrupt traceback
    assert capfd.readouterr().err == "unison: interrupted\n"


def test_warnings_are_one_line_while_the_cli_runs(monkeypatch):
    shown = []

    class Parser:
        def __init__(self, command=None):
            pass

        def parse_args(self, argv):
            return argparse.Namespace(func=lambda ns: shown.append(warnings.formatwarning(
                "skipped 1 unreadable\nimage", UserWarning, "/src/unison/data/memory.py", 86, "  warnings.warn(x)")) or 0)

    before = warnings.formatwarning
    monkeypatch.setattr(unison.cli, "make_parser", Parser)
    assert main(["x"]) == 0
    assert shown == ["unison: warning: skipped 1 unreadable image\n"]   # was "...memory.py:86: UserWarning: ..."
    assert warnings.formatwarning is before   # restored: the CLI's format is the CLI's
