"""Process-group set-up: read who we are from the launcher's variables and join the group.

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
gloo/NCCL) and is refused without an MPI launcher (`check_backend_launcher`).

The rendezvous under mpirun, each value the first that is set (`mpi_rendezvous`):

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

Network interface (`unison.distributed.network.gloo_interface`): unless ``GLOO_SOCKET_IFNAME`` is set,
gloo uses the interface that holds the address through which this host reaches the rendezvous
(``MASTER_ADDR``): loopback for one machine, the cluster network for several (gloo's own choice, the
host name's address, may not exist on the host, e.g. in a container or network namespace, and then
falls back to loopback).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import sys
import zlib
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from unison.config.distributed import DistributedConfig
from unison.config.fields import ascii_digits, parse_int, shown
from unison.errors import ConfigError, WorkerError

from .elastic import previous_group
from .hostlist import expand_hostlist, slurm_port
from .network import gloo_interface, listening_store, torchrun_attempt_store
from .shutdown import shutdown_distributed

T = TypeVar("T")

__all__ = ["LaunchEnv", "apply_launch_env", "check_backend_launcher", "detect_launch_env", "exit_worker",
           "gloo_interface", "init_distributed", "mpi_rendezvous", "restart_count", "restart_reason",
           "shutdown_distributed", "slurm_rendezvous", "torchrun_attempt_store"]


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


def apply_launch_env(cfg: DistributedConfig, launch: LaunchEnv) -> DistributedConfig:
    """A copy of `cfg` whose rank, world size and rendezvous come from the launcher."""
    from dataclasses import replace

    return mpi_rendezvous(replace(
        cfg,
        rank=launch.rank,
        world_size=launch.world_size,
        master_addr=launch.master_addr or _given_or(cfg.master_addr, DistributedConfig.master_addr, launch.default_addr),
        master_port=(launch.master_port if launch.master_port is not None
                     else _given_or(cfg.master_port, DistributedConfig.master_port, launch.default_port)),
        backend="mpi" if launch.source in ("mpi", "slurm") and cfg.backend == "auto" else cfg.backend,
    ), launch)


def _given_or(value: T, default: T, launchers: T | None) -> T:
    """`value` where the user gave one (it is not the option's default), else the launcher's own, else `value`."""
    return launchers if value == default and launchers is not None else value


def mpi_rendezvous(cfg: DistributedConfig, launch: LaunchEnv) -> DistributedConfig:
    """Under mpirun, `cfg` (whose port is the one derived from the job id where none was given) refused when it has
    no port or a loopback address while the ranks run on several nodes (see the module docstring)."""
    if launch.source != "mpi":
        return cfg
    if not cfg.master_port:
        raise ConfigError("no rendezvous port: this mpirun names no job (none of "
                          f"{', '.join(MPI_JOB_ID_VARS)} is set) to derive one from; pass one to every rank: "
                          "mpirun -x MASTER_PORT=<port> (MPICH: -genv MASTER_PORT <port>) or --master-port")
    if launch.one_node is False and _is_loopback(cfg.master_addr):
        raise ConfigError(f"mpirun started the {launch.world_size} ranks on several nodes, so the rendezvous cannot "
                          f"be on loopback ({cfg.master_addr}); give every rank rank 0's host: "
                          "mpirun -x MASTER_ADDR=<rank 0's host> (or --master-addr)")
    return cfg


def check_backend_launcher(cfg: DistributedConfig, launch: LaunchEnv | None) -> None:
    """``--backend mpi`` means "started by an MPI launcher" (it talks gloo/NCCL): refuse it without one."""
    if cfg.backend == "mpi" and (launch is None or launch.source not in ("mpi", "slurm")):
        who = "no launcher started this one" if launch is None else f"{launch.source} started this one"
        raise ConfigError(f"--backend mpi is for workers started by mpirun (or srun) and {who}: start them with "
                          "mpirun -n N unison train ..., or use --backend auto, gloo or nccl")


def check_gpu_per_worker(cfg: DistributedConfig, launch: LaunchEnv | None) -> None:
    """NCCL needs a GPU of its own for each worker of a machine (two ranks on one device fail inside NCCL, after
    start-up): more workers than visible GPUs is one line before any worker starts (unison's launcher: the world
    size; torchrun, srun, mpirun: this rank's local rank), not ranks doubled up on ``cuda:0``."""
    if cfg.backend in ("local", "gloo") or cfg.world_size == 1:
        return
    if cfg.communication_backend() != "nccl":
        return
    gpus = torch.cuda.device_count()
    if launch is None and cfg.world_size > gpus:
        raise ConfigError(f"--world-size {cfg.world_size} with NCCL needs one GPU per worker and this machine shows "
                          f"{gpus} (CUDA_VISIBLE_DEVICES); give --world-size {gpus} or less (the default is one worker "
                          f"per GPU), or --backend gloo for {cfg.world_size} workers on the CPU")
    if launch is not None and launch.local_rank >= gpus:
        raise ConfigError(f"rank {launch.rank} is local rank {launch.local_rank} of a node that shows {gpus} GPU(s), "
                          f"and NCCL needs one GPU per worker: start at most {gpus} processes per node (torchrun "
                          f"--nproc-per-node {gpus}, srun --ntasks-per-node {gpus})")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() in ("localhost", "localhost.localdomain")


def init_distributed(cfg: DistributedConfig, local_rank: int = 0) -> torch.device:
    """Join the process group described by `cfg` and return this worker's device.

    ``local`` (one in-memory process) uses a gloo group over a HashStore, so DDP and
    every collective run unchanged with world size 1.
    """
    cfg.validate()
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process")
    comm = cfg.communication_backend()
    device = torch.device("cpu")
    # NCCL, and a single in-memory process, train on this worker's GPU when there is one; gloo with
    # several workers stays on the CPU (torch's CUDA SyncBatchNorm needs NCCL).
    if comm == "nccl" or (cfg.resolved_backend() == "local" and torch.cuda.is_available()):
        if comm != "nccl" and cfg.shard == "full":
            # Seen on an H100 (torch 2.11): FSDP2's collectives on CUDA tensors over gloo killed the workers
            # (SIGSEGV). Checked here, where the device is known: a configuration may be written for another machine
            raise ConfigError("--shard full on one worker has nothing to shard, and a single CUDA worker's "
                              "in-process group cannot run FSDP's collectives; use --shard none (or 2+ workers)")
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.resolved_backend() == "local":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return device
    gloo_interface(cfg.master_addr)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(comm, store=torchrun_attempt_store(cfg, timeout), rank=cfg.rank,
                                    world_size=cfg.world_size, timeout=timeout)
        else:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 serves a fresh store in every attempt
            dist.init_process_group(comm, init_method="env://", rank=cfg.rank, world_size=cfg.world_size,
                                    timeout=timeout)
        _agree_on_restart(device)
        return device
    if not cfg.master_port:
        raise ConfigError("no rendezvous port: set MASTER_PORT (torchrun/unison set it) or --master-port")
    try:
        store = _rendezvous_store(cfg, timeout)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:   # not all processes joined in time
        raise WorkerError(_rendezvous_failure(cfg, str(exc))) from None
    dist.init_process_group(comm, store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)
    return device


_agreed_restart: int | None = None


def _agree_on_restart(device: torch.device) -> None:
    """Every worker takes the largest restart count of the group as the attempt number (`restart_count`).

    In a multi-node torchrun job only the agent of the node that failed counts a restart; the others would
    start over from scratch (no resume) while the restarted node's workers resume: they must agree."""
    global _agreed_restart
    count = torch.tensor([_env_restart_count()], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    _agreed_restart = int(count.item())


def _rendezvous_failure(cfg: DistributedConfig, error: str) -> str:
    """One line for a rendezvous that timed out: who joined, where, and what to start."""
    where = f"{cfg.master_addr}:{cfg.master_port}"
    if cfg.rank == 0:
        joined = re.search(r"(\d+)/(\d+) clients joined", error)
        count = f"only {joined.group(1)} of {cfg.world_size}" if joined else f"not all {cfg.world_size}"
        return (f"{count} processes joined the rendezvous at {where} within {cfg.timeout_s:g} s; start all "
                f"{cfg.world_size} processes (e.g. mpirun -n {cfg.world_size}, srun -n {cfg.world_size}, torchrun "
                f"--nproc-per-node {cfg.world_size}), or let unison start them (unset the launcher's variables and "
                "pass --world-size)")
    return (f"rank {cfg.rank} could not reach the rendezvous at {where} (served by rank 0) within "
            f"{cfg.timeout_s:g} s; start rank 0 too, and check MASTER_ADDR/MASTER_PORT")


def _rendezvous_store(cfg: DistributedConfig, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous key-value store; rank 0 serves it on `master_addr` only.

    torch's TCPStore server listens on every interface whatever address it is given, so
    rank 0 binds the socket itself (loopback by default) and hands it over.
    """
    if cfg.rank != 0:
        return dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=False, timeout=timeout)
    return listening_store(cfg.master_addr, cfg.master_port, cfg.world_size, timeout)


def restart_count() -> int:
    """torchrun's restart attempt of this worker (0 on the first attempt and outside torchrun): once the group
    is joined, the one all its workers agreed on (`_agree_on_restart`), else this node's agent's count."""
    return _env_restart_count() if _agreed_restart is None else _agreed_restart


def _env_restart_count() -> int:
    return _env_count("TORCHELASTIC_RESTART_COUNT")


def _env_count(name: str) -> int:
    """A launcher's counter in the environment; 0 unless it is ASCII digits up to 2**64."""
    value = os.environ.get(name, "0").strip()
    try:
        return parse_int(value) if ascii_digits(value) else 0
    except ValueError:   # past 2**64: not the launcher's
        return 0


def restart_reason() -> str | None:
    """Why this worker runs a second time, or None: ``restart N`` (torchrun ``--max-restarts``), ``group
    re-formed`` (torchrun ``--nnodes MIN:MAX`` restarted the workers for a node that joined, counting no restart:
    `unison.distributed.elastic`) or ``SLURM requeue N`` (the job was requeued: ``sbatch --requeue`` after a
    preemption or node failure, or ``scontrol requeue``; SLURM sets ``SLURM_RESTART_COUNT``). Either way the run
    continues from the run directory's last checkpoint by itself."""
    if restart_count() > 0:
        return f"restart {restart_count()}"
    if previous_group() is not None:
        return "group re-formed"
    requeued = _env_count("SLURM_RESTART_COUNT")
    if requeued > 0:
        return f"SLURM requeue {requeued}"
    return None


def exit_worker(code: int) -> NoReturn:
    """End this worker process now with `code`, after flushing stdout/stderr, skipping interpreter finalization.

    Why: a worker that finished cleanly (results written, process group destroyed) was still
    killed by SIGABRT ("terminate called without an active exception") in about 1 of 12 short
    gloo runs, always during finalization (no Python frame left), when torch's C++ objects are
    destroyed after the interpreter. Its results were complete, but the launcher, torchrun
    included, saw a crashed worker. Everything a worker produces is written and closed before
    this point (summary, metrics, checkpoints), so nothing is lost by not finalizing.

    multiprocessing's own exit finalizers run first (priority 0 and up, as a normal exit runs them): skipped,
    every semaphore a library made in the worker stayed registered with the resource tracker, which warned at the
    end of the run ("There appear to be 2 leaked semaphore objects": tqdm's default lock, taken by torch.compile's
    graph interpreter in every compiled worker).
    """
    import multiprocessing.util

    try:
        multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]  # private: what a normal exit calls
    except Exception:   # noqa: BLE001 - ending the process matters more than a tidy resource tracker
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
