"""unison under a real Open MPI ``mpirun`` (installed on demand): no MASTER_* needed on one node.

The rendezvous port comes from the job id Open MPI gives every rank, the address is loopback because every rank
runs on this node (unison.distributed.env, `mpi_rendezvous`; the derivations are unit-tested in
tests/distributed/test_launch_env.py, which also covers ``--backend mpi`` without mpirun).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fault_helpers import assert_same_training_state
from helpers.system import ensure_programs

from unison.training.checkpoint import load_checkpoint

from .conftest import TINY


@pytest.mark.slow
def test_mpirun_trains_with_backend_mpi_and_no_master_variables(cluster_reference, tmp_path):
    if (reason := ensure_programs({"mpirun": "openmpi-bin"})) is not None:
        pytest.skip(reason)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "OMPI_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", UNISON_NO_CACHE="1")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PYTHONPATH", "-x", "UNISON_NO_CACHE",
           sys.executable, "-m", "unison.cli", "train", *TINY, "--backend", "mpi", "--out", str(run)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "simclr x2 workers" in proc.stdout and "unison: error" not in proc.stderr, proc.stderr[-4000:]
    assert_same_training_state(load_checkpoint(run), cluster_reference)
