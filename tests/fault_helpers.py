"""Shared by the fault tests (preemption, watchdog, disk faults): processes left behind, leftovers on disk,
the single error line, when an injected fault fired. Not a test module."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from unison.equivalence import assert_states_close
from unison.training.checkpoint import load_checkpoint

FAULT = "UNISON_FAULT_INJECT"
STEPS = 8
# what a test of faults, resumes and checkpoints does not look at: the label-free signals (RankMe, ...: measured at
# the start and the end of every run) and the random-init kNN, about 6 of a 2-worker run's 17 s
# (tests/training/test_resume.py keeps both: the signals' and the random-init kNN's own resume)
QUIET = ["--signal-images", "0", "--no-random-init-knn"]
# digits subset, batch 64, float64: "resumed == uninterrupted" is checked at 1e-9; --log-every 1: metrics every step
TINY = ["--batch-size", "64", "--epochs", "1", "--max-steps", str(STEPS), "--subset", "512", "--val-subset", "64",
        "--knn-k", "5", "--no-progress", "--checkpoint-every", "2", "--precision", "float64", "--timeout-s", "60",
        "--log-every", "1", *QUIET]


@contextlib.contextmanager
def full_tmpfs(target: Path, size: str = "64k", fill: bool = True) -> Iterator[Path]:
    """A real tiny tmpfs at `target` (`fill`: filled up, so the next write fails with ENOSPC); skips where mounting
    is not allowed (it needs root)."""
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount ({proc.stderr.strip() or 'mount failed'}): needs root")
    try:
        if fill:
            with contextlib.suppress(OSError), open(target / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        yield target
    finally:
        for _ in range(20):   # a worker may still be closing a file
            if subprocess.run(["umount", str(target)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parents


def descendants(pid: int, parents: dict[int, int] | None = None) -> set[int]:
    """Every process below `pid` (children, theirs, ...), zombies included."""
    parents = _parents() if parents is None else parents
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _live_cmdline(pid: int) -> bytes | None:
    """The command line of live (not zombie) process `pid`, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (OSError, IndexError):
        return None


def children() -> set[int]:
    """Live processes started by this test process: its children and theirs, except multiprocessing's resource
    tracker and fork server, which live as long as this process. The launcher's workers are the fork server's
    children and are counted (forked, not exec'd: they carry the server's command line, so only the server
    itself, a direct child of this process, is left out by it)."""
    me, parents = os.getpid(), _parents()
    found = {pid: _live_cmdline(pid) for pid in descendants(me, parents)}
    return {pid for pid, cmdline in found.items() if cmdline is not None and b"resource_tracker" not in cmdline
            and not (b"forkserver" in cmdline and parents.get(pid) == me)}


def error_dirs() -> set[str]:
    """What unison's launcher used to leave in the temporary folder when it was killed."""
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("unison-errors-")}


def temporaries(run: Path) -> list[str]:
    """Half-written checkpoint files in a run directory."""
    folder = run / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp")) if folder.is_dir() else []


def fault_time(err: str, kind: str = r"\w+") -> float:
    """When the injected fault fired (the hook prints it)."""
    m = re.search(rf"unison: {FAULT}: {kind}[\w ]* on rank \d+ at step \d+( \(\w+\))? \(t=([\d.]+)\)", err)
    assert m, err
    return float(m.group(2))


def error_line(err: str, prefix: str | tuple[str, ...] = "unison: error:") -> str:
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_cli(argv: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and standard error of ``unison ARGV`` run in this process (argparse's SystemExit counts as an
    exit code); a traceback fails the test."""
    from unison.cli import main

    capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:   # argparse: usage line + one error line
        code = e.code if isinstance(e.code, int) else 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def load_intact(run: Path) -> dict:
    """The latest checkpoint of `run`, which must load itself (no fallback to an older one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return load_checkpoint(run, expect_method="simclr")


def assert_same_training_state(a: dict, b: dict, tol: float = 1e-9) -> None:
    """Model (parameters and buffers) and optimizer state, float64 at `tol`."""
    assert a["step"] == b["step"]
    assert_states_close(a["model"], b["model"], tol, "model")
    assert_states_close(a["optimizer"], b["optimizer"], tol, "optimizer")
