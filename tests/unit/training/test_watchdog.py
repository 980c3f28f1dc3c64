"""Watchdog: a run in which no rank makes progress ends within ``--watchdog-s`` (plus a poll), with one line naming
every rank, its phase (step, collective, data, checkpoint) and step, and whether it is stopped.

Real processes for SIGSTOP of one worker and of all workers, a data loader that blocks and a checkpoint write that
never returns (a hung filesystem); the decision rule and the in-process watcher (other launchers) as units.
"""

from __future__ import annotations

import pytest

from unison.distributed.watchdog import stuck_report

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


# ------------------------------------------------------------------ the rule
def test_the_run_is_stuck_only_when_every_rank_is():
    now = 1000.0
    old, fresh = now - 10, now - 1
    assert stuck_report([("step", 3, old), ("collective", 3, old)], [False, False], 5, now) == (
        "watchdog: no rank made progress for 5 s (--watchdog-s): rank 0 in step at step 3 for 10 s; "
        "rank 1 in collective at step 3 for 10 s")
    assert stuck_report([("step", 3, old), ("collective", 3, fresh)], [False, False], 5, now) is None
    # start-up and evaluation are not watched: a rank there keeps the run alive...
    assert stuck_report([("eval", 3, old), ("collective", 3, old)], [False, False], 5, now) is None
    assert stuck_report([("startup", -1, old), ("startup", -1, old)], [False, False], 5, now) is None
    # ...unless it is stopped
    assert "rank 0 stopped (SIGSTOP) in eval" in stuck_report([("eval", 3, old), ("data", 3, old)], [True, False], 5,
                                                               now)
    assert stuck_report([("step", 3, old)], [False], 0, now) is None   # 0 = off
