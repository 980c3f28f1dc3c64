"""Disk and filesystem faults: a full disk (a real, small tmpfs), a run directory that turns read-only mid-run (a real
read-only bind mount) and a failing disk (EIO from fsync, at the OS boundary) each end the run with exit 4 and one line
that names the checkpoint that could not be written and the last good one, which stays loadable; the run does not
train on without saving.

Mounting needs root (CAP_SYS_ADMIN); without it those tests skip and say so.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import FAULT, TINY, children, error_line, load_intact, temporaries

from unison.cli import main

FLOAT32 = [a if a != "float64" else "float32" for a in TINY]   # 3 MB checkpoints (small CNN, SimCLR head, SGD)


pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


@contextlib.contextmanager
def _mounted(target: Path, *options: str):
    """`mount ... target` for the duration of the block (skips the test where mounting is not allowed)."""
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount ({proc.stderr.strip() or 'mount failed'}): needs root")
    try:
        yield target
    finally:
        for _ in range(20):   # a worker may still be closing a file
            if subprocess.run(["umount", str(target)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)


def _last_logged_step(run: Path) -> int:
    with open(run / "metrics.csv") as f:
        return max(int(float(r["step"])) for r in csv.DictReader(f) if r["step"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("size, world, failed, previous", [
    ("7m", "2", 3, 2),   # two 3 MB checkpoints fit, the third does not
    ("2m", "1", 1, None),   # issue 17's row: not even the first fits
])
def test_full_disk_ends_the_run_and_names_the_last_good_checkpoint(tmp_path, capfd, size, world, failed, previous):
    with _mounted(tmp_path / "fs", "-t", "tmpfs", "-o", f"size={size}", "tmpfs") as fs:
        run = fs / "run"
        before = children()
        capfd.readouterr()
        code = main(["train", *FLOAT32, "--world-size", world, "--checkpoint-every", "1", "--out", str(run)])
        err = capfd.readouterr().err
        assert code == 4, err
        line = error_line(err)
        where = "worker rank 0 failed: CheckpointError: " if world == "2" else ""
        attempted = run / "checkpoints" / f"step_{failed:08d}.pt"
        if previous is None:
            assert line == (f"unison: error: {where}no space left on device: could not write checkpoint {attempted}; "
                            "there is no earlier checkpoint; free space, then start again")
        else:
            last = run / "checkpoints" / f"step_{previous:08d}.pt"
            assert line == (f"unison: error: {where}no space left on device: could not write checkpoint {attempted}; "
                            f"the last good checkpoint is {last} (intact); free space, then continue with --resume auto")
            assert load_intact(run)["step"] == previous
        # the save runs in the background: its failure is agreed after the next step at the latest
        assert _last_logged_step(run) <= failed + 1
        assert not temporaries(run) and not children() - before


_STOPPED_RUN = """
import sys
from unison.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _wait_until_stopped(pid: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.1)
    raise AssertionError("the run never reached its stop")


@pytest.mark.slow
def test_run_directory_turning_read_only_ends_the_run(tmp_path):
    """The run stops itself (SIGSTOP) before step 3; the checkpoint folder is made read-only; the run continues."""
    run = tmp_path / "run"
    env = {**os.environ, FAULT: "rank=0,step=3,kind=stop", "UNISON_NO_CACHE": "1"}
    cmd = [sys.executable, "-c", _STOPPED_RUN, "train", *FLOAT32, "--world-size", "1", "--no-checkpoint-async",
           "--out", str(run)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_until_stopped(proc.pid)
        ckpts = run / "checkpoints"
        with _mounted(ckpts, "--bind", str(ckpts)):
            if subprocess.run(["mount", "-o", "remount,ro,bind", str(ckpts)], capture_output=True).returncode != 0:
                pytest.skip("cannot remount read-only")
            os.kill(proc.pid, signal.SIGCONT)
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 4, err
            assert error_line(err) == (
                f"unison: error: read-only file system: could not write checkpoint {ckpts / 'step_00000004.pt'}; "
                f"the last good checkpoint is {ckpts / 'step_00000002.pt'} (intact)")
            assert load_intact(run)["step"] == 2
            assert _last_logged_step(run) == 4   # it did not train on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_failing_disk_ends_the_run_and_keeps_the_last_checkpoint(tmp_path, capfd, monkeypatch):
    """EIO from fsync on the second checkpoint file (a disk going bad, a flaky network filesystem)."""
    real_fsync, calls = os.fsync, []

    def flaky_fsync(fd: int) -> None:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".step_00000004.pt."):
            calls.append(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky_fsync)
    run = tmp_path / "run"
    capfd.readouterr()
    code = main(["train", *FLOAT32, "--world-size", "1", "--out", str(run)])
    err = capfd.readouterr().err
    monkeypatch.undo()
    assert code == 4 and calls, err
    ckpts = run / "checkpoints"
    assert error_line(err) == (f"unison: error: could not write checkpoint {ckpts / 'step_00000004.pt'} (Input/output "
                               f"error); the last good checkpoint is {ckpts / 'step_00000002.pt'} (intact)")
    assert load_intact(run)["step"] == 2 and not temporaries(run)
    assert _last_logged_step(run) <= 6   # the background save's failure is agreed on within two steps
