"""Faults with real worker processes: a dying or hung worker ends the whole run, promptly, with one line.

Faults are injected with ``UNISON_FAULT_INJECT="rank=R,step=S[,kind=kill|nan|hang|raise]"``, a
testing-only hook of the training loop (tests/fault_injection.py, registered by `_quiet_env`): rank R SIGKILLs
itself (or poisons its loss, or hangs) when it is about to run step S. Runs are tiny (digits subset,
batch 64, 8 steps, float64) so that "resumed == uninterrupted" can be checked at 1e-9."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import QUIET, assert_same_training_state, children, error_line, fault_time, load_intact
from helpers.faults import FAULT

from unison.cli import main
from unison.config import TrainConfig
from unison.config.distributed import DistributedConfig
from unison.distributed.testing import run_in_workers
from unison.errors import WorkerFailure
from unison.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_resuming_a_run_killed_before_its_first_metrics_row(tmp_path):
    from unison.training.metrics import MetricsLogger

    for _ in range(3):  # each attempt fails before logging a row; its header reaches the disk at exit
        MetricsLogger(tmp_path, enabled=True)._file.close()
    MetricsLogger(tmp_path, enabled=True).close()


# -- with real processes --

STEPS = 8


TINY = ["--batch-size", "64", "--epochs", "1", "--max-steps", str(STEPS), "--subset", "512", "--val-subset", "100",
        "--knn-k", "5", "--no-progress", "--checkpoint-every", "2", "--precision", "float64", "--timeout-s", "60",
        "--log-every", "1", *QUIET]  # see test_resuming_a_run_killed_before_its_first_metrics_row for why every step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final checkpoint of an uninterrupted 2-worker run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return load_checkpoint(out)




@pytest.mark.slow
def test_sigkilled_worker_ends_the_run_and_resuming_matches_an_uninterrupted_run(reference, tmp_path, capfd,
                                                                                  monkeypatch):
    rng = random.Random(20261122)
    run, kill_step, report = tmp_path / "run", 0, []
    for round_ in range(2):  # kill -9 a random rank at a random later step; --resume auto picks up each time
        kill_step = rng.randint(max(kill_step + 1, 2), 5 + round_)
        rank = rng.randrange(2)
        monkeypatch.setenv(FAULT, f"rank={rank},step={kill_step}")
        before = children()
        capfd.readouterr()
        code = main(["train", *TINY, "--resume", "auto", "--out", str(run)])
        ended = time.time()
        err = capfd.readouterr().err
        assert code == 1, err
        assert error_line(err) == f"unison: error: worker rank {rank} failed: killed by SIGKILL"
        latency = ended - fault_time(err)
        assert latency < 15, f"the run took {latency:.1f} s to end after the kill"
        assert not children() - before, "a worker process was left behind"
        # The last checkpoint before the kill. Checkpoints are written in the background: when rank 0 (the writer)
        # is killed right after a save began, that save is lost and the one before it is the last complete one.
        last = kill_step // 2 * 2
        assert load_intact(run)["step"] in ({last} if rank == 1 else {last, last - 2})
        report.append(f"round {round_}: killed rank {rank} at step {kill_step}, run ended {latency:.2f} s later")
    monkeypatch.delenv(FAULT)
    assert main(["train", *TINY, "--resume", "auto", "--out", str(run)]) == 0
    assert_same_training_state(load_checkpoint(run), reference)
    print("\n".join(report))


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_with_step_rank_and_hint(tmp_path, capfd, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv(FAULT, "rank=1,step=3,kind=nan")
    capfd.readouterr()
    assert main(["train", *TINY, "--out", str(run)]) == 5
    assert error_line(capfd.readouterr().err) == (
        "unison: error: worker rank 1 failed: NonFiniteLossError: non-finite loss (nan) at step 3 on rank 1; "
        "lower --lr, set --grad-clip, or check the data (the last checkpoint is intact)")
    assert load_intact(run)["step"] == 2
    assert not children()


@pytest.mark.slow
def test_hung_worker_ends_the_run_after_the_collective_timeout(tmp_path, capfd, monkeypatch):
    timeout = 5
    monkeypatch.setenv(FAULT, "rank=1,step=3,kind=hang")
    capfd.readouterr()
    code = main(["train", *TINY, "--timeout-s", str(timeout), "--out", str(tmp_path / "run")])
    ended = time.time()
    err = capfd.readouterr().err
    assert code == 1
    line = error_line(err)
    assert line.startswith("unison: error: worker rank 0 failed: ") and "Timed out" in line, line
    assert line.endswith("(rank 1 did not fail but stopped responding)"), line
    latency = ended - fault_time(err)
    assert timeout <= latency < timeout + 20, f"ended {latency:.1f} s after the hang, timeout {timeout} s"
    assert not children()


def _consistent(seed_by_rank: bool) -> str:
    from unison.distributed import collectives as C
    from unison.training.trainer import consistent_config

    cfg = TrainConfig(seed=C.rank() if seed_by_rank else 0, distributed=DistributedConfig(world_size=2))
    consistent_config(cfg)
    return "ok"


def test_configurations_are_compared_across_ranks():
    assert run_in_workers(_consistent, 2, args=(False,)) == ["ok", "ok"]
    with pytest.raises(WorkerFailure) as info:
        run_in_workers(_consistent, 2, args=(True,))
    assert info.value.error_type == "ConfigError"
    assert "rank 1's configuration differs from rank 0's (seed: 0 vs 1); start every worker with the same options" \
        in str(info.value)


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists() and not shutil.which("torchrun"), reason="torchrun is not installed")
def test_torchrun_restarts_a_killed_worker_which_resumes_by_itself(reference, tmp_path):
    run = tmp_path / "run"
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun's agent store outlives the restart, and unison's workers
    # join it under a key prefix of their attempt (unison.distributed.env.torchrun_attempt_store; pytorch#135712).
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update({FAULT: "rank=1,step=3", "UNISON_NO_CACHE": "1"})
    cmd = [str(TORCHRUN) if TORCHRUN.exists() else "torchrun", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "unison.cli", "train", *TINY, "--out", str(run)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "kill on rank 1 at step 3" in proc.stderr
    assert f"unison: restart 1: resuming from {run / 'checkpoints' / 'step_00000002.pt'}" in proc.stderr
    # torchrun's SIGTERM to rank 0 of attempt 0, if it lands while rank 0 fails after its peer's death: a true line
    assert "before training started" not in proc.stderr, proc.stderr[-4000:]
    for line in re.findall(r"stopped by SIGTERM.*", proc.stderr):
        assert f"after its training had stopped: the last checkpoint is {run / 'checkpoints'}" in line, line
    assert_same_training_state(load_checkpoint(run), reference)


# ------------------------------------------------------------------ rendezvous on loopback
_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


def _listening() -> list[tuple[str, int, bool]]:
    """(kind, port, loopback only) of every socket this worker listens on; kind is 'store' or 'gloo'."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    addr, port = fields[1].split(":")
                    kind = "store" if int(port, 16) == int(os.environ["MASTER_PORT"]) else "gloo"
                    out.append((kind, int(port, 16), addr in _LOOPBACK))
    return out


@pytest.fixture(scope="module")
def listening() -> list[tuple[str, int, bool]]:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux /proc/net/tcp")
    return [s for rank in run_in_workers(_listening, 2) for s in rank]


def test_rendezvous_defaults_to_loopback(listening):
    assert DistributedConfig().master_addr == "127.0.0.1"
    gloo = [s for s in listening if s[0] == "gloo"]
    assert gloo and all(loopback for _, _, loopback in gloo), listening


def test_rendezvous_store_listens_on_loopback_only(listening):
    store = [s for s in listening if s[0] == "store"]
    assert store and all(loopback for _, _, loopback in store), listening
