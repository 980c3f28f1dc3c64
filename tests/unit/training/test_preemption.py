"""`unison.training.preemption.preempted`: the line a stopped run ends with. A SIGTERM while nodes wait to join an
elastic job's group is the group re-forming with more workers, said without "error"; any other stop keeps the
preemption's wording (the processes of a real scale-up: tests/distributed/cluster/test_elastic.py)."""

from __future__ import annotations

import signal

import pytest

from unison.errors import Preempted, error_prefix
from unison.training import preemption
from unison.training.preemption import StopDecision, preempted


@pytest.mark.parametrize("waiting, signum, regroup", [(1, signal.SIGTERM, True), (2, signal.SIGTERM, True),
                                                      (0, signal.SIGTERM, False), (None, signal.SIGTERM, False),
                                                      (1, signal.SIGUSR1, False)])
def test_a_node_joining_is_said_as_such_and_a_preemption_keeps_its_wording(monkeypatch, waiting, signum, regroup):
    monkeypatch.setattr(preemption, "nodes_waiting", lambda: waiting)
    stop = preempted(StopDecision(signal_number=int(signum), signal_rank=0), 3, 8, "run/checkpoints/step_00000003.pt")
    assert isinstance(stop, Preempted) and stop.exit_code == 75 and stop.regroup is regroup
    if regroup:
        nodes = "1 node" if waiting == 1 else f"{waiting} nodes"
        assert str(stop).startswith(f"stopped by SIGTERM after step 3 of 8 for {nodes} joining: ")
        assert str(stop).endswith(" re-forms the group with more workers, which resume from there (checkpoint "
                                  "run/checkpoints/step_00000003.pt written)")
        assert error_prefix(stop) == ""   # the CLI's line and train.log's: "unison: stopped by ...", no "error"
    else:
        assert str(stop).startswith(f"preempted by {signal.Signals(signum).name} (received by rank 0) after step 3")
        assert "continue with --resume auto and the same --out" in str(stop) and error_prefix(stop) == "error: "
