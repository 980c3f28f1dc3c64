"""What the cluster tests (a real SLURM, a real mpirun, two network-namespace hosts under torchrun) share: the tiny run and its
uninterrupted 2-worker reference, trained once per session by unison's own launcher."""

from __future__ import annotations

import pytest
from helpers.netns import two_hosts  # noqa: F401  (a fixture of test_hosts)

from unison.cli import main
from unison.training.checkpoint import load_checkpoint

STEPS = 4
# digits subset, float64: "resumed == uninterrupted" holds at 1e-9; a checkpoint every 2 steps, so a worker killed at
# step 3 resumes from step 2.
TINY = ["--batch-size", "64", "--epochs", "1", "--max-steps", str(STEPS), "--subset", "256", "--val-subset", "64",
        "--knn-k", "5", "--no-progress", "--checkpoint-every", "2", "--precision", "float64", "--timeout-s", "60",
        "--log-every", "1", "--no-random-init-knn"]


@pytest.fixture(scope="session")
def cluster_reference(tmp_path_factory) -> dict:
    """The final checkpoint of an uninterrupted 2-worker run of `TINY`."""
    out = tmp_path_factory.mktemp("cluster_reference") / "run"
    assert main(["train", *TINY, "--world-size", "2", "--out", str(out)]) == 0
    return load_checkpoint(out)
