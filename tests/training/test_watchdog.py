"""Watchdog: a run in which no rank makes progress ends within ``--watchdog-s`` (plus a poll), with one line naming
every rank, its phase (step, collective, data, checkpoint) and step, and whether it is stopped.

Real processes for SIGSTOP of one worker and of all workers, a data loader that blocks and a checkpoint write that
never returns (a hung filesystem); the decision rule and the in-process watcher (other launchers) as units."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest
from fault_helpers import FAULT, TINY, children, error_line, fault_time, load_intact

from unison.cli import main
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


# -- with real processes --

WATCHDOG_S = 6


# the machine is shared and loaded: generous bound on the time from the fault to the end of the run
MARGIN_S = 20




def _stuck_run(tmp_path, fault: str, capfd, monkeypatch) -> tuple[str, float]:
    monkeypatch.setenv(FAULT, fault)
    before = children()
    capfd.readouterr()
    code = main(["train", *TINY, "--watchdog-s", str(WATCHDOG_S), "--out", str(tmp_path / "run")])
    ended = time.time()
    err = capfd.readouterr().err
    assert code == 1, err
    assert not children() - before, "a worker process was left behind"
    latency = ended - fault_time(err)
    assert WATCHDOG_S <= latency < WATCHDOG_S + MARGIN_S, f"ended {latency:.1f} s after the fault"
    return error_line(err), latency


PREFIX = f"unison: error: watchdog: no rank made progress for {WATCHDOG_S} s (--watchdog-s): "


@pytest.mark.distributed
@pytest.mark.slow
def test_one_sigstopped_worker_ends_the_run_within_the_watchdog_time(tmp_path, capfd, monkeypatch):
    line, latency = _stuck_run(tmp_path, "rank=1,step=3,kind=stop", capfd, monkeypatch)
    assert line.startswith(PREFIX), line
    assert re.search(r"rank 0 in (step|collective) at step 3 for \d+ s; rank 1 stopped \(SIGSTOP\) in step at step 3 "
                     r"for \d+ s; the last checkpoint is \S+step_00000002.pt; continue with --resume auto", line), line
    assert load_intact(tmp_path / "run")["step"] == 2
    print(f"SIGSTOP of rank 1: ended {latency:.1f} s after the stop (watchdog {WATCHDOG_S} s)")


@pytest.mark.distributed
@pytest.mark.slow
def test_all_workers_sigstopped_end_the_run_within_the_watchdog_time(tmp_path, capfd, monkeypatch):
    line, latency = _stuck_run(tmp_path, "rank=0,step=3,kind=stop;rank=1,step=3,kind=stop", capfd, monkeypatch)
    assert line.startswith(PREFIX), line
    assert "rank 0 stopped (SIGSTOP) in step at step 3" in line and "rank 1 stopped (SIGSTOP) in step at step 3" in line
    print(f"SIGSTOP of every worker: ended {latency:.1f} s after the first stop (watchdog {WATCHDOG_S} s)")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_blocked_data_loader_is_named(tmp_path, capfd, monkeypatch):
    line, latency = _stuck_run(tmp_path, "rank=1,step=3,kind=hang,at=data", capfd, monkeypatch)
    assert line.startswith(PREFIX) and "rank 1 in data at step 3" in line, line
    assert re.search(r"rank 0 in (step|collective) at step 3", line), line
    print(f"blocked data loader on rank 1: ended {latency:.1f} s later")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_write_that_never_returns_is_named(tmp_path, capfd, monkeypatch):
    """A hung filesystem: the background save of step 2 never finishes; the save of step 4 waits for it."""
    line, latency = _stuck_run(tmp_path, "rank=0,step=2,kind=hang,at=save", capfd, monkeypatch)
    assert line.startswith(PREFIX) and "rank 0 in checkpoint at step 4" in line, line
    assert "no checkpoint was written" in line   # the only save in flight never completed
    print(f"hung checkpoint write at step 2: ended {latency:.1f} s later (steps 3-4, then the watchdog)")


def test_the_in_process_watchdog_ends_a_stuck_worker_outside_unisons_launcher(tmp_path):
    """Under torchrun/srun each worker watches itself: a step stuck longer than the limit ends the process (exit 1)."""
    code = textwrap.dedent("""
        import time
        from unison.distributed.watchdog import Watchdog
        watch = Watchdog(rank=3, limit_s=1.0, poll_s=0.1)
        watch.enter("step", 0)           # not armed yet: start-up is not watched
        time.sleep(2.0)
        watch.arm()
        watch.enter("collective", 7)
        time.sleep(30)
        print("not reached")
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 1 and "not reached" not in proc.stdout
    assert proc.stderr.strip().endswith("unison: error: watchdog: rank 3 made no progress for 1 s (--watchdog-s) in "
                                        "collective at step 7; ending this worker"), proc.stderr
    assert 3.0 <= took < 25, took


_IN_CALLER = """
import sys, threading, time
from unison.distributed.watchdog import Stuck, Watchdog, reading

def stuck_read(result):
    watch = Watchdog(rank=0, limit_s=1.0, poll_s=0.1, in_caller=True)
    try:
        with reading():   # a read that never returns (here: {how}), before the first step
            {how}
    except Stuck:
        result.append(watch.stuck)
    finally:
        watch.close()

result = []
if sys.argv[1] == "main":
    stuck_read(result)
else:
    t = threading.Thread(target=stuck_read, args=(result,))
    t.start()
    t.join()
print(result[0])
print("the caller goes on")
"""


@pytest.mark.parametrize("thread, how", [("main", "time.sleep(3600)"), ("main", "threading.Event().wait()"),
                                         ("other", "while True: time.sleep(0.01)")])
def test_the_watchdog_of_a_run_in_the_callers_process_raises_there(thread, how):
    """One worker without a launcher trains in the caller's process (a notebook's kernel): a stuck read raises
    `Stuck` in the thread that trains, and the process goes on (a launched worker's ends: the test above). The main
    thread is woken from a blocking sleep or lock by a signal; another thread at its next Python instruction."""
    code = textwrap.dedent(_IN_CALLER).replace("{how}", how)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, thread], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "watchdog: no progress for 1 s (--watchdog-s) in read (of an image or an item of your dataset) before the "
        "first step; the run was ended", "the caller goes on"], proc.stdout + proc.stderr
    assert time.monotonic() - started < 90   # generous under load: a hang would be for ever
