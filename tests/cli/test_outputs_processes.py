"""What needs real processes of the output rules: one owner per run directory (a second run is refused while the
first lives, and is not refused by a dead one), and a SIGKILLed streaming run that leaves no process behind (its
data-loader processes and multiprocessing's resource tracker die with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import descendants

from unison.cli import main

W1 = ["--world-size", "1", "--batch-size", "8", "--max-steps", "2", "--no-random-init-knn", "--no-progress",
      "--subset", "64", "--val-subset", "16", "--knn-k", "5"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "UNISON_NO_CACHE": "1"}

_HOLD = """
import sys, time
from unison.training.owner import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _one_error(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("unison: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_live_run_owns_its_directory_and_a_dead_one_does_not(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("UNISON_NO_CACHE", "1")
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        capfd.readouterr()
        assert main(["train", *W1, "--out", str(run)]) == 2
        line = _one_error(capfd)
        assert line.startswith(f"unison: error: run directory {run} is in use by another run (pid {holder.pid} on ")
        assert line.endswith("wait for it to end, or choose another --out")
        assert not (run / "metrics.csv").exists() and not (run / "checkpoints").exists()
        assert not (run / "train.log").exists()   # not even a line in the owner's log
    finally:
        holder.kill()   # a killed owner (preemption, a crash) holds nothing: its restart is not refused
        holder.wait()
    assert main(["train", *W1, "--out", str(run)]) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigkilled_streaming_run_leaves_no_process(tmp_path):
    """`--data-mode stream` with loader processes under unison's launcher: SIGKILL the launcher; within 5 s no
    process it started is left (workers, their loader processes, the resource tracker)."""
    from unison.data.generated import write_image_folder

    write_image_folder(tmp_path / "train", 48, classes=2, sizes=(16, 24), seed=1)
    argv = [sys.executable, "-m", "unison.cli", "train", "--data", str(tmp_path / "train"), "--data-mode", "stream",
            "--loader-workers", "2", "--world-size", "2", "--batch-size", "8", "--max-steps", "100000",
            "--no-random-init-knn", "--no-progress", "--image-size", "16", "--out", str(tmp_path / "run")]
    launcher = subprocess.Popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline, family = time.monotonic() + 120, set()
        while time.monotonic() < deadline:   # 2 workers with 2 loader processes each, and the resource tracker
            family = descendants(launcher.pid)
            if len(family) >= 7 and (tmp_path / "run" / "metrics.csv").exists():
                break
            assert launcher.poll() is None, launcher.communicate()[1]
            time.sleep(0.5)
        assert len(family) >= 7, family
        family = descendants(launcher.pid)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in family):
            time.sleep(0.1)
        assert not [p for p in family if _alive(p)], "processes outlived the SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in descendants(launcher.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.distributed
def test_a_forked_child_does_not_keep_the_run_directory(tmp_path):
    """A process forked while the lock is held (a data-loader process) closes its copy: when the run ends, the
    directory is free even though the child lives on."""
    from unison.training.owner import RunDirLock

    lock = RunDirLock(tmp_path)
    lock.acquire()
    ready, say_ready = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child (its copy of the lock is closed by now): outlive the parent's release for a while
        os.write(say_ready, b"x")
        time.sleep(20)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"x"   # the child runs (a child not yet scheduled still has the copy)
        lock.release()
        with RunDirLock(tmp_path):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        os.close(say_ready)
