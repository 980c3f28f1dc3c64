"""Faults with real worker processes: a dying or hung worker ends the whole run, promptly, with one line.

Faults are injected with ``UNISON_FAULT_INJECT="rank=R,step=S[,kind=kill|nan|hang|raise]"``, a
testing-only hook of the training loop (tests/fault_injection.py, registered by `_quiet_env`): rank R SIGKILLs
itself (or poisons its loss, or hangs) when it is about to run step S. Runs are tiny (digits subset,
batch 64, 8 steps, float64) so that "resumed == uninterrupted" can be checked at 1e-9.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_resuming_a_run_killed_before_its_first_metrics_row(tmp_path):
    from unison.training.metrics import MetricsLogger

    for _ in range(3):  # each attempt fails before logging a row; its header reaches the disk at exit
        MetricsLogger(tmp_path, enabled=True)._file.close()
    MetricsLogger(tmp_path, enabled=True).close()
