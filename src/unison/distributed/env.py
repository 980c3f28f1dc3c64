"""Process-group set-up: join the group that the launcher's variables describe (`unison.distributed.launch_env`
reads them: which launchers, and the rendezvous each implies).

The network side of joining a group: which address and interface this host uses, stores that listen on one
address, and the store of a torchrun restart attempt.

* `gloo_interface`: unless ``GLOO_SOCKET_IFNAME`` is set, gloo uses the interface that holds the address through
  which this host reaches the rendezvous (``MASTER_ADDR``): loopback for one machine, the cluster network for
  several (gloo's own choice, the host name's address, may not exist on the host, e.g. in a container or network
  namespace, and then falls back to loopback).
* `listening_store`: torch's TCPStore server listens on every interface whatever host it is given; this one
  binds the socket itself and hands it over.
* `torchrun_attempt_store`: a fresh store per torchrun restart attempt, served by rank 0.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import re
import secrets
import socket
import struct
import sys
import time
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from unison.config.distributed import DistributedConfig
from unison.config.fields import ascii_digits, parse_int
from unison.errors import ConfigError, WorkerError

from .collectives import is_distributed
from .elastic import previous_group
from .launch_env import MPI_JOB_ID_VARS, LaunchEnv, detect_launch_env, slurm_rendezvous
from .shutdown import shutdown_distributed

T = TypeVar("T")

__all__ = ["LaunchEnv", "apply_launch_env", "check_backend_launcher", "detect_launch_env", "exit_worker",
           "gloo_interface", "init_distributed", "mpi_rendezvous", "restart_count", "restart_reason",
           "shutdown_distributed", "slurm_rendezvous", "torchrun_attempt_store"]


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
            # FSDP2's collectives on CUDA tensors over gloo crash the workers (SIGSEGV), so they never start.
            # Checked here, where the device is known: a configuration may be written for another machine
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
    is joined, the one all its workers agreed on (`_agree_on_restart`), else this node's agent's count. The agreed
    count is that group's: once the process has left it (an in-process run that ended), the environment's again."""
    if _agreed_restart is None or not is_distributed():
        return _env_restart_count()
    return _agreed_restart


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

    Why: a worker that finished cleanly (results written, process group destroyed) can still be
    killed by SIGABRT ("terminate called without an active exception") during finalization (no
    Python frame left), when torch's C++ objects are destroyed after the interpreter. Its results
    are complete, but the launcher, torchrun included, would see a crashed worker. Everything a
    worker produces is written and closed before this point (summary, metrics, checkpoints), so
    nothing is lost by not finalizing.

    multiprocessing's own exit finalizers run first (priority 0 and up, as a normal exit runs them): skipped,
    every semaphore a library made in the worker would stay registered with the resource tracker, which warns at
    the end of the run ("There appear to be N leaked semaphore objects": tqdm's default lock, taken by
    torch.compile's graph interpreter in every compiled worker).
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


# ---- the network side: the interface gloo uses, stores listening on one address, a restart attempt's store

def listening_store(addr: str, port: int, world_size: int, timeout: datetime.timedelta,
                     wait_for_workers: bool = True) -> dist.TCPStore:
    """A TCPStore server listening on `addr` only (port 0: a free one); see `_rendezvous_store`."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {addr}:{port} for the rendezvous ({exc.strerror}); "
                          "choose another --master-port or --master-addr") from None
    store = dist.TCPStore(addr, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                          master_listen_fd=sock.fileno(), wait_for_workers=wait_for_workers)
    sock.detach()  # the store serves on this descriptor from now on; Python must not close it
    return store


def _source_address(host: str) -> str | None:
    """This host's address on the route to `host` (no packet is sent), or None when `host` is unreachable."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
            except OSError:
                continue
    return None


_SIOCGIFADDR = 0x8915


def _interface_with(addr: str) -> str | None:
    """The name of the network interface holding address `addr` (Linux), or None."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return None
    if ip.version == 6:   # /proc/net/if_inet6: "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
        try:
            with open("/proc/net/if_inet6") as f:
                rows = [line.split() for line in f.read(1 << 20).splitlines()]
        except OSError:
            return None
        return next((row[5] for row in rows if len(row) == 6 and row[0] == ip.exploded.replace(":", "")), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:   # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def gloo_interface(master_addr: str) -> str | None:
    """Point gloo at the interface through which this host reaches `master_addr` (``GLOO_SOCKET_IFNAME``, unless
    the user set it); the interface's name, or None when left to gloo.

    gloo otherwise takes the address of the host name, which in a container or network namespace may be
    an address the host does not have (gloo then falls back to loopback and its peers on other hosts get
    127.0.0.1), or another network than the cluster's. With it, gloo listens on that interface's address,
    not on every interface: loopback for a single machine (``MASTER_ADDR`` 127.0.0.1)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    source = _source_address(master_addr)
    name = _interface_with(source) if source else None
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name   # read by every gloo group this process creates
    return name


_ATTEMPT_PROBE_S = 2.0   # connecting to the store a dead rank 0 served fails (refused) within this


def torchrun_attempt_store(cfg: DistributedConfig, timeout: datetime.timedelta) -> dist.Store:
    """A fresh store for this restart attempt, served by rank 0 and announced through torchrun's shared store.

    Why: since torch 2.5 torchrun's agent serves the workers' store itself (``TORCHELASTIC_USE_AGENT_STORE``,
    unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and that server lives as long as the agent: it is
    created at the first rendezvous and reused for every restart. torch <= 2.4 gave each attempt its own
    key prefix (``/worker/attempt_N``); the fix of pytorch#135712 (PR #135957) removed the prefix on the
    assumption that every retry gets a new server, which torch 2.14's ``DynamicRendezvousHandler`` does
    not do. Restarted workers then share the namespace ``default_pg/`` with the dead ones and can read
    their gloo addresses: ``failed to connect ... Connection refused`` and a rendezvous that hangs until
    ``--timeout-s``. A prefix per attempt number does not
    do either: the number (``TORCHELASTIC_RESTART_COUNT``) is each agent's own count, and in a multi-node
    job only the failed node's agent counts a restart (a healthy one restarts its workers for the waiting
    node without counting), so the hosts' workers would use different prefixes and hang.

    So rank 0 serves a store of its own (on its address towards ``MASTER_ADDR``, not a wildcard) and
    publishes ``<nonce> <addr> <port>`` in the agent's store; the others connect to what is published.
    A stale announcement, a dead rank 0's, is recognised by its store being gone (by the time any worker
    of a round runs, every agent has stopped its previous workers) or not holding the nonce: they wait
    for the next one. https://github.com/pytorch/pytorch/issues/135712
    """
    agent = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=False, timeout=timeout)
    # per group size too: a group re-formed at another size never even reads the announcements of the previous one
    key = f"unison/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt_store/{cfg.world_size}"
    if cfg.rank == 0:
        addr = _source_address(cfg.master_addr) or cfg.master_addr
        nonce = secrets.token_hex(16)
        store = listening_store(addr, 0, cfg.world_size, timeout, wait_for_workers=False)
        store.set("unison/nonce", nonce)
        agent.set(key, f"{nonce} {addr} {store.port}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    stale: set[bytes] = set()
    while time.monotonic() < deadline:
        announced = agent.get(key) if agent.check([key]) else b""
        if announced and announced not in stale:
            joined = _attempt_store_at(announced, cfg.world_size, timeout)
            if joined is not None:
                return joined
            stale.add(announced)
        time.sleep(0.1)
    raise WorkerError(f"rank {cfg.rank} found no store of this restart attempt served by rank 0 (announced in "
                      f"torchrun's store at {cfg.master_addr}:{cfg.master_port}) within {cfg.timeout_s:g} s; "
                      "check that rank 0's worker started")


def _attempt_store_at(announced: bytes, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store rank 0 announced, or None when it is a dead attempt's (gone, or without the nonce)."""
    parts = announced.decode("ascii", "replace").split(" ")
    if len(parts) != 3 or not ascii_digits(parts[2]) or not 0 < int(parts[2]) < 65536 or len(parts[1]) > 253:
        return None
    nonce, addr, port = parts[0], parts[1], int(parts[2])
    probe = datetime.timedelta(seconds=_ATTEMPT_PROBE_S)
    try:   # a plain connect first: a dead store is refused at once, without torch's retries and log lines
        socket.create_connection((addr, port), timeout=_ATTEMPT_PROBE_S).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=probe, wait_for_workers=False)
        if store.get("unison/nonce").decode("ascii", "replace") != nonce:
            return None
    except (dist.DistError, RuntimeError):   # refused, unreachable, or not a store: a dead attempt's
        return None
    store.set_timeout(timeout)
    return store
