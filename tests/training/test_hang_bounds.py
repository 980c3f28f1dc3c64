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

import pytest
from fault_helpers import descendants

from unison.training.checkpoint import latest_checkpoint
from unison.training.checkpoint.files import step_of

# the code under test: PYTHONPATH's when set (a check of these tests against other code), else this tree's
ENV = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[2] / "src"),
       "UNISON_NO_CACHE": "1"}
QUIET = ["--no-random-init-knn", "--no-progress", "--signal-images", "0", "--val-subset", "64", "--knn-k", "5"]
QUICK = [*QUIET, "--subset", "512"]


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


_BLOCKING = """
import inspect, os, sys, time
import torch
import unison
import unison.errors
from unison.config import DistributedConfig, TrainConfig

def _in(name):
    # a function of that name, or a method of a class of that name, is reading the item
    return any(f.function == name or type(f.frame.f_locals.get("self")).__name__ == name for f in inspect.stack())

class Blocking(torch.utils.data.Dataset):
    '''64 images; a read of item 5 never returns where argv[2] says: "checks" (read by the checks before training),
    "loader" (any item, in a loader process: the first batch), "build" (the worker's build: the image-size probe and
    the channel statistics), "signals" (the held-back images of the quality signals, read when their hook starts).'''
    def __init__(self):
        self.pid = os.getpid()
    def __len__(self):
        return 64
    def __getitem__(self, i):
        where = sys.argv[2]
        if {"checks": i == 5, "loader": os.getpid() != self.pid, "build": i == 5 and _in("_build"),
                "signals": i == 5 and _in("HeldBack")}[where]:
            time.sleep(3600)
        return torch.rand(3, 16, 16)

if __name__ == "__main__":
    cfg = TrainConfig(out=sys.argv[1], max_steps=3, batch_size=8, random_init_knn=False, progress=False,
                      signal_images=64 if sys.argv[2] == "signals" else 0, loader_workers=1,
                      distributed=DistributedConfig(world_size=1, watchdog_s=4))
    try:
        unison.train(cfg, dataset=Blocking())
        print("not reached")
    except unison.errors.UnisonError as e:   # the caller's process goes on (a notebook keeps its kernel)
        print(f"unison: error: {e}", file=sys.stderr)
        print(f"the caller goes on after {type(e).__name__}")
        sys.exit(e.exit_code)
"""


def _blocked_run(tmp_path, where: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "blocking.py"
    script.write_text(_BLOCKING)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), where], env=ENV,
                          capture_output=True, text=True, timeout=240)   # generous: a loaded machine starts torch slowly
    return proc, time.monotonic() - started


@pytest.mark.parametrize("where, line", [
    ("checks", "no progress for 4 s (--watchdog-s) while checking the data before training"),
    ("loader", "no progress for 4 s (--watchdog-s) in data at step 0; the run was ended"),
    ("build", "no progress for 4 s (--watchdog-s) in read (of an image or an item of your dataset) before the first "
              "step; the run was ended"),
    ("signals", "no progress for 4 s (--watchdog-s) in read (of an image or an item of your dataset) before the "
                "first step; the run was ended"),
])
def test_a_dataset_item_that_blocks_before_the_first_step_raises_in_the_caller(tmp_path, where, line):
    """One worker, --watchdog-s 4, an item that never returns: read by the pre-flight's look at the data, by the
    loader process that makes the first batch, by the worker's build, or for the signals' held-back images. Each
    hung for ever (the last two also after the first two were watched: the build was not); now `WatchdogTimeout`
    in the caller, about 4 s later, naming the phase. One worker trains in the caller's process, which the
    watchdog ended before (a notebook lost its kernel): the script catches the exception and goes on."""
    proc, took = _blocked_run(tmp_path, where)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("unison: error:")]
    assert proc.returncode == 1 and "not reached" not in proc.stdout, proc.stderr
    assert "the caller goes on after WatchdogTimeout" in proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and line in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert took < 200, took   # a hang would be for ever: any bound tells them apart


def _train(argv: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "unison.cli", "train", "--out", str(tmp_path / "run"), *argv],
                          env={**ENV, **env}, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


def _error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("unison: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("accumulation, world", [("exact", 1), ("independent", 1), ("exact", 2)])
def test_sigterm_in_a_long_step_of_many_micro_batches_ends_it(tmp_path, accumulation, world):
    """--grad-sync-every 8: SIGTERM at the first micro-batch of step 1 ends the run at the next micro-batch, exit
    75, the checkpoint of step 1 kept (it finished steps 1 and 2 first: with K = 100,000 that was hours).
    --accumulation independent: the micro-batches are also computed one by one, each a place to stop. Two
    workers: the signal to the launcher, which forwards it; the workers leave without waiting for each other."""
    tests = str(Path(__file__).resolve().parents[1])
    to = ",to=launcher" if world > 1 else ""
    proc, _ = _train(["--world-size", str(world), "--batch-size", "8", "--grad-sync-every", "8", "--max-steps", "3",
                      "--checkpoint-every", "1", "--accumulation", accumulation, *QUIET], tmp_path,
                     UNISON_TRAIN_HOOKS="fault_injection", UNISON_FAULT_INJECT=f"rank=0,step=1,kind=term,at=data{to}",
                     PYTHONPATH=f"{ENV['PYTHONPATH']}{os.pathsep}{tests}")
    line = _error(proc)
    assert proc.returncode == 75, proc.stderr
    assert "stopped by SIGTERM during step 1 (micro-batch 1 of 8" in line and "step_00000001.pt" in line, line
    assert _latest_step(tmp_path / "run") == 1


def test_a_step_beyond_the_data_is_refused_in_one_line(tmp_path):
    """--grad-sync-every 100000 (800,000 images in one step, no check, no progress) and K x batch just above the
    data (a step silently spanning two epochs): one line before anything starts."""
    for k, most in (("100000", "179"), ("180", "179")):
        proc, took = _train(["--batch-size", "8", "--grad-sync-every", k, "--max-steps", "1"], tmp_path)
        line = _error(proc)
        assert proc.returncode != 0 and f"give --grad-sync-every at most {most}" in line, line
        assert not (tmp_path / "run").exists()


def test_sigterm_to_embed_is_one_line_and_leaves_nothing(tmp_path):
    """SIGTERM to `unison embed` as soon as it works (its hidden parts folder exists): exit 75 with one line, no
    parts folder, no temporary or partial output (it exited 143 without a word and left the parts folder)."""
    from unison.config import TrainConfig
    from unison.data.generated import write_image_folder
    from unison.methods import get_method
    from unison.models import build_backbone
    from unison.training.checkpoint import save_checkpoint

    # 4,000 images at batch 1 keep it embedding for ~4 s after the parts folder appears: with 400 (0.8 s) a
    # loaded CI machine sometimes let it finish before the signal was sent
    write_image_folder(tmp_path / "data", 4000, classes=2, sizes=(16, 24), seed=0)
    net, dim = build_backbone("small_cnn", 16)
    cls = get_method("simclr")
    save_checkpoint(tmp_path / "run", {"method": "simclr", "model": cls(net, dim, cls.Params()).state_dict(),
                                       "config": TrainConfig(backbone="small_cnn", image_size=16).to_dict(),
                                       "resolved": {"backbone": "small_cnn", "image_size": 16, "mean": [0.5] * 3,
                                                    "std": [0.2] * 3}}, step=0)
    out = tmp_path / "out" / "features.npy"
    argv = [sys.executable, "-m", "unison.cli", "embed", "--checkpoint", str(tmp_path / "run"), "--data",
            str(tmp_path / "data"), "--out", str(out), "--batch-size", "1", "--threads", "1"]
    proc = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((tmp_path / "out").glob(".features.npy.parts-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if ln.startswith("unison: error:")]
    assert proc.returncode == 75 and len(lines) == 1 and "stopped by SIGTERM" in lines[0], (proc.returncode, err)
    assert not list((tmp_path / "out").iterdir())
