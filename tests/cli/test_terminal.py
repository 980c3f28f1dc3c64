"""`unison train` in a terminal, with real processes: SIGINT to a background run's process group (with --no-knn, which
skips the evaluation) says interrupted and how to resume; a smoke run in a 100-column terminal says what evaluation
will cost and keeps its progress bar."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import unison

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = ["--no-progress", "--batch-size", "32", "--subset", "128", "--val-subset", "32", "--knn-k", "5"]


SRC = Path(unison.__file__).resolve().parents[1]   # the code under test (the checkout's, or another's)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "UNISON_NO_CACHE": "1", **extra}


def _as_background_job() -> None:
    """What `cmd &` in a script does to the job: its own process group, SIGINT ignored."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_to_a_background_runs_process_group_says_interrupted_and_how_to_resume(tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "unison.cli", "train", *TINY, "--max-steps", "400", "--checkpoint-every", "2",
            "--no-knn", "--signal-images", "0", "--out", str(run)]   # --no-knn: no evaluation (nor its note)
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_background_job)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*.pt")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)   # kill -INT -PGID: the launcher ignores it, its workers do not
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("unison: interrupted; the last checkpoint is ") and "KeyboardInterrupt" not in err
    assert last.endswith(f"; continue with --resume auto --out {run}") and "failed" not in last, err[-3000:]
    assert "unison: kNN evaluation skipped: --no-knn" in err and "kNN evaluation embeds" not in err


def _in_terminal(argv: list[str], columns: int, timeout: float = 240) -> tuple[int, str]:
    """Run `argv` with a terminal of `columns` columns as its standard streams: (exit code, what it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:   # EIO: every writer of the terminal is gone
                    break
                if not data:
                    break
                shown += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), shown.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_smoke_run_in_a_100_column_terminal_says_what_evaluation_costs_and_keeps_its_bar(tmp_path):
    run = tmp_path / "run"
    code, shown = _in_terminal([sys.executable, "-m", "unison.cli", "train", *TINY[1:], "--max-steps", "3",
                                "--out", str(run)], columns=100)
    assert code == 0, shown[-3000:]
    lines = shown.replace("\r\n", "\n").replace("\r", "\n").splitlines()
    note = next((ln for ln in lines if "kNN evaluation embeds" in ln), "")
    assert note.startswith("unison: the kNN evaluation embeds 128 reference and 32 held-out images before training "
                           "and at the end: 320 images, more than the 96 this run trains on (3 steps)"), shown[-3000:]
    assert "--no-knn skips it" in note
    bars = [ln for ln in lines if ln.startswith("simclr x2:") and "loss" in ln]
    assert bars, shown[-3000:]
    for bar in bars:   # tqdm draws one column short of the width
        assert len(bar) <= 99 and bar.endswith("]"), bar                # no metric cut off
        assert len(bar.split("|")[1]) >= 10, bar                        # a bar, 10 columns at least
        assert re.search(r", loss \d+\.\d{4}, \d+ img/s", bar), bar
    assert bars[-1].startswith("simclr x2: 100%|" + "\u2588" * 10), bars[-1]
