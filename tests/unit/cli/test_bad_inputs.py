"""Numbers as recipes write them (``1e9`` epochs, ``1e-3`` learning rates), parsed in this process.

The table of bad inputs, each answered with one line and an exit code, is tests/distributed/cli/test_bad_inputs.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_integral_numbers_in_scientific_notation_are_integers():
    """``--epochs 1e9`` (run by steps) and ``epochs: 1e9`` in YAML are the integer 10**9; 1e-3 is a float."""
    from unison.cli.train_args import parse_train_args

    assert parse_train_args(["--epochs", "1e9", "--max-steps", "5"]).epochs == 10**9
    assert parse_train_args(["--epochs", "1_000"]).epochs == 1000
    cfg = parse_train_args(["--param", "temperature=1e-1", "--lr", "1e-3"])
    assert cfg.method_params == {"temperature": 0.1} and cfg.lr == 0.001
