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
gloo (CPU) or NCCL (GPU) and needs a rendezvous address and port (``MASTER_ADDR``/``MASTER_PORT``).

Under srun nothing has to be set by hand (`slurm_rendezvous`); in order of precedence:

* address: ``MASTER_ADDR``, else ``--master-addr`` (when not the default 127.0.0.1), else derived from the
  step's node list (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, SLURM's compressed syntax
  ``node[01-03,7]``, see `expand_hostlist`): ``127.0.0.1`` when the step runs on one node (every task is on
  this machine; loopback keeps the rendezvous off the network, as unison's own launcher does), else the
  list's first host name, where task 0 runs (srun places tasks in node-list order), which must resolve on
  every node to an address of that node.
* port: ``MASTER_PORT``, else ``--master-port`` (when not 0), else derived from ``SLURM_JOB_ID`` and
  ``SLURM_STEP_ID`` (`slurm_port`): a port in [10000, 30000), below Linux's ephemeral range, different for
  the steps of one job (two ``srun &`` in one script) and for jobs near in number (sharing a node); a
  requeued job gets its port again (its previous processes are gone).
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from unison.config.distributed import DistributedConfig
from unison.config.fields import parse_int, shown
from unison.errors import ConfigError, WorkerError

T = TypeVar("T")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    source: str  # "torchrun" (also unison's launcher), "mpi", "slurm"
    # The launcher's own rendezvous (srun: derived from the job), used where neither MASTER_ADDR/MASTER_PORT
    # nor --master-addr/--master-port give one.
    default_addr: str | None = None
    default_port: int | None = None


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
        return LaunchEnv(_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0,
                         addr, port, "mpi")
    if "PMI_RANK" in env:
        return LaunchEnv(_int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                         _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else 0, addr, port, "mpi")
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


SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
MAX_HOSTLIST_CHARS = 1 << 16
MAX_HOST_RANGES = 16   # bracketed ranges in one host name (SLURM itself writes one or two)


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of step `step_id` of SLURM job `job_id`, in [10000, 30000).

    ``job * 31 + step`` modulo 20000 (31 is prime to 20000): step 0 of two jobs shares a port only when
    their numbers differ by a multiple of 20000, and steps 0-30 of jobs fewer than 645 apart never do.
    The range stays below Linux's ephemeral ports (32768 up), which outgoing connections hold."""
    return SLURM_PORT_BASE + (job_id * 31 + step_id) % SLURM_PORT_SPAN


_HOSTLIST_ITEM = re.compile(r"([^\[\],]*)(\[[^\[\]]*\])?")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> Iterator[str]:
    """The host names of a SLURM node list in its compressed syntax, in order: ``node[01-03,7],gpu-a[1-2]`` gives
    node01 node02 node03 node7 gpu-a1 gpu-a2 (zero padding kept; several brackets in a name expand as a product).
    The whole list is checked first, then names are made as they are walked: a list of a million nodes costs
    nothing until then. Raises ValueError on a malformed list.

    Why not ``scontrol show hostnames``: it is a process per rank and needs the SLURM client on the task's
    PATH, which containers started by srun (enroot, Apptainer) usually lack; the syntax is small."""
    if not text or len(text) > MAX_HOSTLIST_CHARS or not text.isascii() or any(c.isspace() for c in text):
        raise ValueError(text)
    items = [_parse_host_pattern(item, text) for item in _split_top_level(text)]
    return itertools.chain.from_iterable(_names(parts) for parts in items)


# A host pattern: literal text and number ranges (first, last, zero-padded width), in order.
_Part = str | list[tuple[int, int, int]]


def _parse_host_pattern(item: str, text: str) -> list[_Part]:
    parts: list[_Part] = []
    pos = 0
    while pos < len(item):
        m = _HOSTLIST_ITEM.match(item, pos)
        if m is None or m.end() == pos:
            raise ValueError(text)
        parts.append(m.group(1))
        if m.group(2):
            parts.append([_parse_range(r, text) for r in m.group(2)[1:-1].split(",")])
        pos = m.end()
        if len(parts) > 2 * MAX_HOST_RANGES:   # `_names` recurses once per part
            raise ValueError(text)
    return parts


def _parse_range(spec: str, text: str) -> tuple[int, int, int]:
    """``01-03`` -> (1, 3, 2): the width of the first number pads the others."""
    m = _RANGE.fullmatch(spec)
    if m is None:
        raise ValueError(text)
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if len(lo) > 12 or len(hi) > 12 or int(hi) < int(lo):
        raise ValueError(text)
    return int(lo), int(hi), len(lo)


def _names(parts: list[_Part]) -> Iterator[str]:
    """The names of one host pattern, made one at a time (itertools.product would build every range first)."""
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    choices = [head] if isinstance(head, str) else (str(n).zfill(w) for lo, hi, w in head for n in range(lo, hi + 1))
    for choice in choices:
        for tail in _names(rest):
            yield choice + tail


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise ValueError(text)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(text)
    items.append(text[start:])
    if any(not item for item in items):
        raise ValueError(text)
    return items


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

    return replace(
        cfg,
        rank=launch.rank,
        world_size=launch.world_size,
        master_addr=launch.master_addr or _given_or(cfg.master_addr, DistributedConfig.master_addr, launch.default_addr),
        master_port=(launch.master_port if launch.master_port is not None
                     else _given_or(cfg.master_port, DistributedConfig.master_port, launch.default_port)),
        backend="mpi" if launch.source in ("mpi", "slurm") and cfg.backend == "auto" else cfg.backend,
    )


def _given_or(value: T, default: T, launchers: T | None) -> T:
    """`value` where the user gave one (it is not the option's default), else the launcher's own, else `value`."""
    return launchers if value == default and launchers is not None else value


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
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if cfg.resolved_backend() == "local":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return device
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(comm, store=torchrun_attempt_store(cfg, timeout), rank=cfg.rank,
                                    world_size=cfg.world_size, timeout=timeout)
        else:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 serves a fresh store in every attempt
            dist.init_process_group(comm, init_method="env://", rank=cfg.rank, world_size=cfg.world_size,
                                    timeout=timeout)
        return device
    if not cfg.master_port:
        raise ConfigError("no rendezvous port: set MASTER_PORT (torchrun/unison set it) or --master-port")
    try:
        store = _rendezvous_store(cfg, timeout)
    except (dist.DistStoreError, dist.DistNetworkError) as exc:   # not all processes joined in time
        raise WorkerError(_rendezvous_failure(cfg, str(exc))) from None
    dist.init_process_group(comm, store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)
    return device


def torchrun_attempt_store(cfg: DistributedConfig, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's shared store, seen through a prefix of this restart attempt.

    Why: since torch 2.5 torchrun's agent serves the workers' store itself (``TORCHELASTIC_USE_AGENT_STORE``,
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and that server lives as long as the agent: it is
    created at the first rendezvous and reused for every restart. torch <= 2.4 gave each attempt its own
    key prefix (``/worker/attempt_N``); the fix of pytorch#135712 (PR #135957) removed the prefix on the
    assumption that every retry gets a new server, which torch 2.14's ``DynamicRendezvousHandler`` does
    not do. Restarted workers then share the namespace ``default_pg/`` with the dead ones and can read
    their gloo addresses: ``failed to connect ... Connection refused`` and a rendezvous that hangs until
    ``--timeout-s`` (seen in 1 of 3 restarts of a 2-worker gloo run). A prefix per attempt, as torch <= 2.4
    had, gives every attempt fresh keys. Caveat (the reason torch dropped it): the attempt number is each
    agent's own count, so a multi-node job whose agents restarted a different number of times (a node
    replaced mid-job) must set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    https://github.com/pytorch/pytorch/issues/135712
    """
    store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=False, timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"unison/{run_id}/attempt_{restart_count()}", store)


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
    family = socket.AF_INET6 if ":" in cfg.master_addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.master_addr, cfg.master_port))
        sock.listen(max(128, cfg.world_size))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {cfg.master_addr}:{cfg.master_port} for the rendezvous ({exc.strerror}); "
                          "choose another --master-port or --master-addr") from None
    store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=True, timeout=timeout,
                          master_listen_fd=sock.fileno())
    sock.detach()  # the store serves on this descriptor from now on; Python must not close it
    return store


def restart_count() -> int:
    """torchrun's restart attempt of this worker (0 on the first attempt and outside torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    try:
        return parse_int(value) if value.isdigit() else 0
    except ValueError:   # past 2**64: not torchrun's
        return 0


def restart_reason() -> str | None:
    """Why this worker runs a second time, or None: ``restart N`` (torchrun ``--max-restarts``) or
    ``SLURM requeue N`` (the job was requeued: ``sbatch --requeue`` after a preemption or node failure,
    or ``scontrol requeue``; SLURM sets ``SLURM_RESTART_COUNT``). Either way the run continues from the
    run directory's last checkpoint by itself."""
    if restart_count() > 0:
        return f"restart {restart_count()}"
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    if requeued.isdigit() and int(requeued) > 0:
        return f"SLURM requeue {int(requeued)}"
    return None


def exit_worker(code: int) -> NoReturn:
    """End this worker process now with `code`, after flushing stdout/stderr, skipping interpreter finalization.

    Why: a worker that finished cleanly (results written, process group destroyed) was still
    killed by SIGABRT ("terminate called without an active exception") in about 1 of 12 short
    gloo runs, always during finalization (no Python frame left), when torch's C++ objects are
    destroyed after the interpreter. Its results were complete, but the launcher, torchrun
    included, saw a crashed worker. Everything a worker produces is written and closed before
    this point (summary, metrics, checkpoints), so nothing is lost by not finalizing.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
