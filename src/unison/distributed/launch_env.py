"""Who this process is, as its launcher says: `detect_launch_env` reads the launcher's variables, without
importing torch (``unison train`` checks them before anything slow), and `slurm_rendezvous` what an srun step implies.

Recognised launchers (first match wins):

* unison's own launcher and ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``.
* Open MPI (``mpirun``): ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``; PMI (MPICH, Intel MPI): ``PMI_RANK``, ``PMI_SIZE``.
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, in a job step
  (``SLURM_STEP_ID`` set: only srun's tasks have it). An ``sbatch`` script's own shell also has
  ``SLURM_PROCID=0`` and, with ``--ntasks``, ``SLURM_NTASKS``, but no step: ``unison train`` run
  there directly is no SLURM worker and starts its workers itself, as on any machine.

PyPI wheels of torch have no MPI backend, so an mpirun/SLURM launch communicates over
gloo (CPU) or NCCL (GPU); ``--backend mpi`` means exactly that (launched by mpirun, talks
gloo/NCCL) and is refused without an MPI launcher (`unison.distributed.env.check_backend_launcher`).

The rendezvous under mpirun, each value the first that is set (`unison.distributed.env.mpi_rendezvous`):

* port: ``MASTER_PORT``, ``--master-port``, else derived from the job id every rank of one job
  shares (``OMPI_MCA_ess_base_jobid``: Open MPI 4; ``PMIX_NAMESPACE``: Open MPI 5 and other PMIx
  launchers), hashed (CRC-32) into ``MPI_PORT_RANGE`` (20000-29999, below Linux's ephemeral ports).
* address: ``MASTER_ADDR``, ``--master-addr``, else 127.0.0.1, which is refused when the ranks run on
  several nodes (``OMPI_COMM_WORLD_LOCAL_SIZE`` < ``OMPI_COMM_WORLD_SIZE``; PMI: ``MPI_LOCALNRANKS`` <
  ``PMI_SIZE``): ``mpirun -x MASTER_ADDR=<rank 0's host>``.

Under srun nothing has to be set by hand (`slurm_rendezvous`); in order of precedence:

* address: ``MASTER_ADDR``, else ``--master-addr`` (when not the default 127.0.0.1), else derived from the
  step's node list (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, SLURM's compressed syntax
  ``node[01-03,7]``, see `unison.distributed.hostlist`): ``127.0.0.1`` when the step runs on one node (every task is on
  this machine; loopback keeps the rendezvous off the network, as unison's own launcher does), else the
  list's first host name, where task 0 runs (srun places tasks in node-list order), which must resolve on
  every node to an address of that node.
* port: ``MASTER_PORT``, else ``--master-port`` (when not 0), else derived from ``SLURM_JOB_ID`` and
  ``SLURM_STEP_ID`` (`slurm_port`): a port in [10000, 30000), below Linux's ephemeral range, different for
  the steps of one job (two ``srun &`` in one script) and for jobs near in number (sharing a node); a
  requeued job gets its port again (its previous processes are gone).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

from unison.config.fields import parse_int, shown
from unison.errors import ConfigError

from .hostlist import expand_hostlist, slurm_port

__all__ = ["MPI_JOB_ID_VARS", "LaunchEnv", "detect_launch_env", "slurm_rendezvous"]


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun" (also unison's launcher), "mpi", "slurm"
    # The launcher's own rendezvous (srun: from the job step; mpirun: the port from the job id), used where
    # neither MASTER_ADDR/MASTER_PORT nor --master-addr/--master-port give one.
    default_addr: str | None = None
    default_port: int | None = None
    one_node: bool | None = None  # mpirun: every rank on this node (None: the launcher does not say)


# Ports derived from an MPI job id: below Linux's ephemeral range (32768-60999), where the OS picks ports.
MPI_PORT_RANGE = (20000, 29999)
# The variables naming an MPI job, the same on every rank of it (Open MPI 4; PMIx: Open MPI 5, srun --mpi=pmix).
MPI_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


def _mpi_launch(env: dict[str, str], rank_var: str, size_var: str, local_rank_var: str, local_size_var: str,
                addr: str | None, port: int | None) -> LaunchEnv:
    """An MPI rank: its launcher's variables, the port derived from the MPI job's id (None: no id) and whether all
    ranks run on this node."""
    size = _int(env, size_var)
    job = next((env[var] for var in MPI_JOB_ID_VARS if env.get(var, "").strip()), None)
    low, high = MPI_PORT_RANGE
    job_port = None if job is None else low + zlib.crc32(job.strip().encode("utf-8", "replace")) % (high - low + 1)
    one_node = _int(env, local_size_var) == size if local_size_var in env else None
    return LaunchEnv(_int(env, rank_var), size, _int(env, local_rank_var) if local_rank_var in env else 0, addr, port,
                     "mpi", default_port=job_port, one_node=one_node)


def _int(environ: dict[str, str], key: str) -> int:
    """An integer environment variable, parsed by the one bounded parser (its range is the config field's)."""
    try:
        return parse_int(environ[key])
    except ValueError:   # NumberOutOfRange included: no 4300-digit ValueError, no huge rank
        raise ConfigError(f"environment variable {key}={shown(environ[key])} is not an integer below 2**64") from None


# A launcher sets the rank and the size together; one without the other is a broken launch, refused before start.
# (SLURM is not listed: a batch script has SLURM_PROCID=0 without SLURM_NTASKS, and salloc the reverse.)
_RANK_AND_SIZE = (("RANK", "WORLD_SIZE", "torchrun"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"),
                  ("PMI_RANK", "PMI_SIZE", "mpirun (MPICH, Intel MPI)"))


def detect_launch_env(environ: dict[str, str] | None = None) -> LaunchEnv | None:
    """The launcher's view of this process, or None when no launcher variables are set.

    Raises `ConfigError` when a launcher's rank variable is set without its size (``OMPI_COMM_WORLD_RANK``
    without ``OMPI_COMM_WORLD_SIZE``) or a variable is not an integer."""
    env = dict(os.environ if environ is None else environ)
    for rank_var, size_var, launcher in _RANK_AND_SIZE:
        if rank_var in env and size_var not in env:
            raise ConfigError(f"environment variable {rank_var}={shown(env[rank_var])} is set but {size_var} is not; "
                              f"{launcher} sets both: start the workers with it, or unset {rank_var} to let "
                              "unison start them")
    addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                         addr, port, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi_launch(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                           "OMPI_COMM_WORLD_LOCAL_SIZE", addr, port)
    if "PMI_RANK" in env:
        return _mpi_launch(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", addr, port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _slurm_step(env) is not None:
        default_addr, default_port = slurm_rendezvous(env)
        return LaunchEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                         _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0, addr, port, "slurm",
                         default_addr, default_port)
    return None


def _slurm_step(env: dict[str, str]) -> int | None:
    """The job step of an srun task (``SLURM_STEP_ID``, older SLURM ``SLURM_STEPID``); None outside srun."""
    key = "SLURM_STEP_ID" if "SLURM_STEP_ID" in env else "SLURM_STEPID" if "SLURM_STEPID" in env else None
    return _int(env, key) if key else None


def slurm_rendezvous(env: dict[str, str]) -> tuple[str | None, int | None]:
    """The rendezvous address and port that an srun step implies (see the module docstring); None where the
    variables it is derived from are missing. Raises `ConfigError` on a malformed node list or number."""
    key = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    addr = None
    if key in env and "MASTER_ADDR" not in env:   # (a given address needs no node list, even a broken one)
        try:
            hosts = expand_hostlist(env[key])
            first, second = next(hosts), next(hosts, None)
        except ValueError:
            raise ConfigError(f"environment variable {key}={shown(env[key][:200])} is not a SLURM node list "
                              "(like node[01-03,7]); set MASTER_ADDR to the host of task 0") from None
        addr = "127.0.0.1" if second is None else first
    step = _slurm_step(env)
    port = slurm_port(_int(env, "SLURM_JOB_ID"), step or 0) if "SLURM_JOB_ID" in env else None
    return addr, port
