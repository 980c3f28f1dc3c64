"""Start N local worker processes that rendezvous on loopback, and end them all together.

``launch(target, payload, cfg)`` spawns ``cfg.world_size`` processes (``spawn`` start
method, so no CUDA or thread state leaks in), each with the variables torchrun would
set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the
worker code path is identical under unison, torchrun, SLURM and mpirun.

Failure policy: the parent polls its children. When one exits non-zero or is killed,
the others are terminated (SIGTERM, then SIGKILL after a grace period) and
`WorkerFailure` is raised naming the first failing rank and its cause (the worker's
exception, written to a per-rank error file, or the signal that killed it); its exit code
is that of the worker's own `UnisonError` (`unison.errors`). On success `launch` returns
each rank's return value, sent back through a pipe. Children
ask the kernel to kill them if the parent dies (PR_SET_PDEATHSIG), so no orphan
survives a killed launcher. Hand-written rather than `torch.multiprocessing.spawn`
because we need the error text of the *first* failure, the bounded shutdown and the
death signal.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from unison.errors import WorkerError, exit_code_of

from .config import DistributedConfig
from .env import exit_worker


class WorkerFailure(WorkerError):
    """A worker process failed; `rank` and `cause` say which and why.

    `error_type` is the class name of the worker's exception (None when it was killed or
    exited without one); `exit_code` is the exit code of that exception when it was a
    `UnisonError` (a `DataError` on rank 1 ends the command with 3), else 1; `traceback`
    is the worker's traceback.
    """

    def __init__(self, rank: int, cause: str, error_type: str | None = None, traceback: str = "",
                 exit_code: int | None = None):
        super().__init__(f"worker rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause
        self.error_type = error_type
        self.traceback = traceback
        self.exit_code = exit_code or 1


def find_free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: deliver SIGKILL to this process when its parent exits."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


def _worker_main(target: Callable[[Any], Any], payload: Any, env: dict[str, str], error_file: str,
                 threads: int, result_conn: Any) -> None:
    _die_with_parent()
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(threads)
        result = target(payload)
        # Plain pickle, in-band: torch's multiprocessing pickler would pass tensors as shared-memory handles
        # that die with this process. The launcher reads while it polls, so a large result cannot block.
        result_conn.send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        result_conn.close()
    except BaseException as exc:  # report every failure, SystemExit included
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            exit_worker(0)
        with open(error_file, "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                       "exit_code": exit_code_of(exc), "traceback": traceback.format_exc()}, f)
        exit_worker(1)
    exit_worker(0)


def _describe_exit(code: int | None, error_file: str) -> str:
    if os.path.exists(error_file):
        try:
            with open(error_file) as f:
                err = json.load(f)
            # drop the C++ source location gloo/NCCL put first: "[.../unbound_buffer.cc:129] Timed out ..."
            message = re.sub(r"^\[[^\]]*:\d+\] ", "", err["message"])
            return f"{err['type']}: {message}"
        except (OSError, ValueError, KeyError):
            pass
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _is_comm_error(cause: str) -> bool:
    return any(k in cause for k in ("DistBackendError", "Connection", "connection", "Gloo", "gloo", "NCCL",
                                    "Timed out", "timed out", "Timeout"))


def _first_failure(procs: list[mp.Process], error_files: list[str]) -> WorkerFailure | None:
    """The most likely root cause among the workers that have failed so far.

    A peer that lost its partner fails too, with a communication error; prefer a worker
    killed by a signal, then one whose error is not a communication error, then the lowest rank.
    """
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if not failed:
        return None
    causes = {r: _describe_exit(code, error_files[r]) for r, code in failed}

    def priority(item: tuple[int, int | None]) -> tuple[int, int]:
        r, code = item
        if code is not None and code < 0:
            return (0, r)
        return (2 if _is_comm_error(causes[r]) else 1, r)

    r, _ = min(failed, key=priority)
    try:
        with open(error_files[r]) as f:
            err = json.load(f)
        return WorkerFailure(r, causes[r], err.get("type"), err.get("traceback", ""), err.get("exit_code"))
    except (OSError, ValueError, AttributeError):
        return WorkerFailure(r, causes[r])


def launch(target: Callable[[Any], Any], payload: Any, cfg: DistributedConfig, *,
           poll_s: float = 0.05, grace_s: float = 5.0, settle_s: float = 3.0, threads_per_worker: int | None = None,
           extra_env: dict[str, str] | None = None) -> list[Any]:
    """Run `target(payload)` in `cfg.world_size` processes; return their results by rank.

    Raises `WorkerFailure` if any worker fails.
    """
    cfg.validate()
    port = cfg.master_port or find_free_port(cfg.master_addr)
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // cfg.world_size)
    ctx = mp.get_context("spawn")
    errdir = tempfile.mkdtemp(prefix="unison-errors-")
    procs: list[mp.Process] = []
    pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.world_size)]   # (read end, write end) per rank
    results: dict[int, Any] = {}
    error_files = [os.path.join(errdir, f"rank{r}.json") for r in range(cfg.world_size)]
    try:
        for r in range(cfg.world_size):
            env = {"RANK": str(r), "WORLD_SIZE": str(cfg.world_size), "LOCAL_RANK": str(r),
                   "LOCAL_WORLD_SIZE": str(cfg.world_size), "MASTER_ADDR": cfg.master_addr,
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
            p = ctx.Process(target=_worker_main, args=(target, payload, env, error_files[r], threads, pipes[r][1]),
                            name=f"unison-rank{r}", daemon=False)
            p.start()
            pipes[r][1].close()   # the child holds the write end; EOF then means it is gone
            procs.append(p)
        conns = [read for read, _ in pipes]
        failure: WorkerFailure | None = None
        while failure is None and any(p.is_alive() for p in procs):
            _receive_results(conns, results)
            failure = _first_failure(procs, error_files)
            if failure is None:
                time.sleep(poll_s)
        if failure is not None and (procs[failure.rank].exitcode or 0) >= 0:
            # Workers often fail together: a peer that lost its partner fails with a communication
            # error before the partner's own exit is visible, and ranks that hit the same bad input
            # fail at once. Let the others show up (ends as soon as all have exited), then report by
            # cause and lowest rank, so the report does not depend on timing. A kill needs no wait.
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                time.sleep(poll_s)
            failure = _first_failure(procs, error_files) or failure
        if failure is not None and _is_comm_error(failure.cause):
            silent = [str(r) for r, p in enumerate(procs) if p.is_alive() and r != failure.rank]
            if silent:  # a peer that neither failed nor answered: hung (the collective timed out, --timeout-s)
                failure.cause += f" (rank {', '.join(silent)} did not fail but stopped responding)"
                failure.args = (f"worker rank {failure.rank} failed: {failure.cause}",)
        if failure is None:
            for p in procs:
                p.join()
            failure = _first_failure(procs, error_files)
        if failure is not None:
            raise failure
        _receive_results(conns, results)
        return [results.get(r) for r in range(cfg.world_size)]
    finally:
        for read, _ in pipes:
            read.close()
        _terminate_all(procs, grace_s)
        for f in error_files:
            if os.path.exists(f):
                os.remove(f)
        os.rmdir(errdir)


def _receive_results(conns: list[Any], results: dict[int, Any]) -> None:
    """Take each finished worker's result off its pipe (EOF without a result: it failed or returned nothing)."""
    for r, conn in enumerate(conns):
        if r in results or conn.closed:
            continue
        try:
            if conn.poll():
                results[r] = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            results[r] = None


def _terminate_all(procs: list[mp.Process], grace_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
