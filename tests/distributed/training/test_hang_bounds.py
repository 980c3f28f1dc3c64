"""Runs that must end by themselves within a stated bound, met as a user met them: workers orphaned by a SIGKILLed
launcher, a SIGTERM in the middle of a long step of many micro-batches, a dataset item that blocks a one-worker
run (start-up is watched too), and a SIGTERM to ``unison embed``. Real processes, digits or tiny data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fault_helpers import descendants

from unison.training.checkpoint import latest_checkpoint
from unison.training.checkpoint.files import step_of

# the code under test: PYTHONPATH's when set (a check of these tests against other code), else this tree's
ENV = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[3] / "src"),
       "UNISON_NO_CACHE": "1"}
QUICK = ["--no-random-init-knn", "--no-progress", "--signal-images", "0", "--subset", "512", "--val-subset", "64",
         "--knn-k", "5"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _latest_step(run: Path) -> int:
    latest = latest_checkpoint(run)
    return -1 if latest is None else step_of(latest)


def _kill_family(pid: int) -> None:
    for p in descendants(pid) | {pid}:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_of_a_sigkilled_launcher_stop_at_once(tmp_path):
    """SIGKILL the launcher of a 2-worker run that checkpoints every step: its workers write at most the checkpoint
    already being written (they trained on for 3-4 s and wrote up to 35 more), and every process is gone in 10 s
    (the fork server's own teardown takes seconds, the workers' end does not wait for it)."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "unison.cli", "train", "--world-size", "2", "--batch-size", "8", "--max-steps",
            "100000", "--checkpoint-every", "1", "--keep-checkpoints", "100000", "--out", str(run), *QUICK]
    with open(tmp_path / "stderr", "w") as err:
        launcher = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _latest_step(run) < 3 and time.monotonic() < deadline:
            assert launcher.poll() is None, (tmp_path / "stderr").read_text()
            time.sleep(0.1)
        family = descendants(launcher.pid)
        launcher.kill()
        launcher.wait()
        at_kill = _latest_step(run)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in family):
            time.sleep(0.05)
        assert not [p for p in family if _alive(p)], "processes outlived the SIGKILLed launcher by 10 s"
        assert _latest_step(run) <= at_kill + 1, f"checkpoints up to step {_latest_step(run)} after {at_kill}"
    finally:
        _kill_family(launcher.pid)
