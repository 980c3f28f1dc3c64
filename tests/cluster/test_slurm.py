"""unison under a real SLURM cluster (slurmctld + slurmd + munged on this machine, `helpers.slurm_cluster`).

* ``srun -N1 -n2 unison train`` with no rendezvous variable set trains, and its result equals unison's own
  2-worker launch tensor for tensor (float64, 1e-9);
* examples/slurm/train.sbatch, signalled with ``scancel --batch --signal=USR1`` (what ``--signal=B:USR1@60``
  sends before the time limit), stops the workers with a checkpoint, requeues itself, and the requeued job
  continues by itself to the same final state;
* ``srun -n2 unison train --world-size 3``: every rank refuses it with one line, exit 2.

The tests skip with one line where no cluster can be started (not root, SLURM/munge not installable).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import FAULT, assert_same_training_state
from helpers.slurm_cluster import SlurmCluster, skip_reason

import unison
from unison.training.checkpoint import load_checkpoint

from .conftest import TINY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
SRC = Path(unison.__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# A stop requested before step 1 is acted on after step 3 (the ranks agree one step late,
# unison.training.preemption), so the requeued job resumes from step 3 and runs step 4 of TINY's 4.
ARGS = TINY
UNISON = [sys.executable, "-m", "unison.cli"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
    except RuntimeError as exc:   # the daemons would not start here (e.g. no munge in a container): one line
        pytest.skip(" ".join(str(exc).split())[:300])
    yield slurm
    slurm.stop()


@pytest.fixture
def reference(cluster, cluster_reference) -> dict:
    """The uninterrupted 2-worker run of unison's own launcher (conftest.py), once the cluster is up."""
    return cluster_reference


@pytest.fixture
def env() -> dict[str, str]:
    """For the workers: this checkout's unison and the test-only fault hook; no rendezvous variable."""
    path = os.pathsep.join([str(TESTS), str(SRC)])
    return {"PYTHONPATH": path, "UNISON_NO_CACHE": "1", "UNISON_TRAIN_HOOKS": "fault_injection"}


def test_srun_trains_without_rendezvous_variables(cluster, reference, env, tmp_path):
    out = tmp_path / "run"
    assert not any(k.startswith("MASTER_") for k in cluster.env)
    proc = cluster.run(["srun", "-N1", "-n2", "--cpus-per-task=1", *UNISON, "train", *ARGS, "--out", str(out)],
                       check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "simclr x2 workers, 4 steps" in proc.stdout
    assert_same_training_state(load_checkpoint(out), reference)


def _wait_for(ready, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sbatch_job_signalled_before_its_time_limit_requeues_itself_and_resumes(cluster, reference, env, tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.out"
    # Both workers wait before step 1 until they are signalled (tests/fault_injection.py, first attempt only).
    env.update({"UNISON": " ".join(UNISON), FAULT: "rank=0,step=1,kind=wait;rank=1,step=1,kind=wait"})
    job = cluster.run(["sbatch", "--parsable", f"--output={log}", str(SCRIPT), *ARGS, "--out", str(out)],
                      env=env).stdout.strip().split(";")[0]
    _wait_for(lambda: log.exists() and log.read_text().count("wait on rank") == 2, "the workers to reach step 1")
    # What --signal=B:USR1@60 does before the time limit: USR1 to the batch script only, which forwards it.
    cluster.run(["scancel", "--batch", "--signal=USR1", job])
    _wait_for(lambda: cluster.job_state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), "the job to end")
    text = log.read_text()
    assert cluster.job_state(job) == "COMPLETED", text[-3000:]
    assert "SIGUSR1 received" in text and "after step 3 of 4" in text, text[-3000:]
    assert "stopped with a checkpoint; requeueing" in text, text[-3000:]
    assert f"unison: SLURM requeue 1: resuming from {out / 'checkpoints' / 'step_00000003.pt'}" in text, text[-3000:]
    assert re.search(r"Restarts=1\b", cluster.run(["scontrol", "show", "job", job]).stdout)
    assert "simclr x2 workers, 4 steps" in text
    assert_same_training_state(load_checkpoint(out), reference)


def test_srun_task_count_that_disagrees_with_world_size_is_refused_on_every_rank(cluster, env, tmp_path):
    proc = cluster.run(["srun", "-n2", "--cpus-per-task=1", *UNISON, "train", "--world-size", "3", *ARGS,
                        "--out", str(tmp_path / "run")], check=False, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("unison: error:")]
    assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert all("--world-size 3 but srun started 2 worker processes" in line and "srun -n 3" in line
               for line in lines), lines
    assert not (tmp_path / "run").exists()
