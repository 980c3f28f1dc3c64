"""Checkpoints: round trip, pruning, crash safety (simulated and real SIGKILL), safe loading, messages."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers.checkpoint import _temporaries

from unison.training.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)

try:
    import numpy as np
except ImportError:  # numpy is optional for unison
    np = None


# ------------------------------------------------------------------ real SIGKILL
# Imports torch once, then per line "STEP" on stdin forks a writer that saves STEP+1, STEP+2, ...
# (16 MB each, so most of the time is spent writing and fsyncing) until the test SIGKILLs it.
_WRITER = """
import os, sys, torch
from unison.training.checkpoint import save_checkpoint
run_dir, payload = sys.argv[1], torch.empty(4_000_000)
while line := sys.stdin.readline():
    step = int(line)
    pid = os.fork()
    if pid == 0:
        try:
            while True:
                step += 1
                payload.fill_(step)
                state = {"method": "simclr", "config": {"n": 1}, "payload": payload, "check": step}
                save_checkpoint(run_dir, state, step, keep=2)
                print(f"ready {os.getpid()}", flush=True)
        finally:
            os._exit(1)
    print(f"exit {os.waitpid(pid, 0)[1]}", flush=True)
"""


def _check_after_kill(run_dir: Path, last_step: int) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the latest file itself loads: no fallback needed
        ckpt = load_checkpoint(run_dir, expect_method="simclr")
    assert latest_checkpoint(run_dir).name == f"step_{ckpt['step']:08d}.pt"
    assert ckpt["check"] == ckpt["step"] > last_step
    assert torch.all(ckpt["payload"] == ckpt["step"])
    for path in list_checkpoints(run_dir):  # every file with a final name is complete
        assert load_checkpoint(path)["step"] == int(path.stem.split("_")[1])
    return ckpt["step"]


@pytest.mark.slow
def test_sigkill_during_saves_always_leaves_a_loadable_latest(tmp_path):
    rng = random.Random(1234)
    last_step, mid_write, kills, child = 0, 0, 8, None
    driver = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(kills):  # each round resumes from the latest step the previous kill left
            driver.stdin.write(f"{last_step}\n")
            driver.stdin.flush()
            ready = driver.stdout.readline().split()  # the writer completed one save and goes on
            assert ready and ready[0] == "ready", driver.stderr.read() if driver.poll() is not None else ready
            child = int(ready[1])
            time.sleep(rng.uniform(0.02, 0.3))
            os.kill(child, signal.SIGKILL)
            while (line := driver.stdout.readline()).startswith("ready"):
                pass
            child = None  # reaped by the driver
            status = int(line.split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, line

            mid_write += bool(_temporaries(tmp_path))
            last_step = _check_after_kill(tmp_path, last_step)
    finally:
        if child is not None:  # never leave a writer running after a failure
            os.kill(child, signal.SIGKILL)
        driver.stdin.close()
        driver.kill()
        driver.wait(timeout=30)
        driver.stdout.close()
        driver.stderr.close()
    print(f"{mid_write} of {kills} kills left a half-written temporary file")
