"""Bad input never shows a traceback: `unison train` answers with one line and a distinct exit code.

Every case drives ``unison.cli.main([...])`` in this process and asserts the exit code, a fragment
of the message and that stderr holds no traceback. Most cases fail in the parent (argument
parsing, `validate()`, the pre-flight of `cmd_train`) before any worker starts; a few are found
by a worker (in-process at world size 1, or in real worker processes) and must still reach the
user as one line. docs/reliability.md lists every case with its exact message; set
``UNISON_BAD_INPUT_LOG=FILE`` to append each case's exit code and message to FILE as JSON lines
(that is how the table is refreshed).

Exit codes: 1 worker failed, 2 configuration or usage, 3 data, 4 checkpoint, 5 non-finite loss.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_image_cache(monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")  # also inherited by spawned workers


def test_integral_numbers_in_scientific_notation_are_integers():
    """``--epochs 1e9`` (run by steps) and ``epochs: 1e9`` in YAML are the integer 10**9; 1e-3 is a float."""
    from unison.cli.train_args import parse_train_args

    assert parse_train_args(["--epochs", "1e9", "--max-steps", "5"]).epochs == 10**9
    assert parse_train_args(["--epochs", "1_000"]).epochs == 1000
    cfg = parse_train_args(["--param", "temperature=1e-1", "--lr", "1e-3"])
    assert cfg.method_params == {"temperature": 0.1} and cfg.lr == 0.001
