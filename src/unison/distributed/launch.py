"""Start N local worker processes that rendezvous on loopback, and end them all together.

``launch(target, payload, cfg)`` starts ``cfg.world_size`` processes, each with the variables torchrun would
set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the
worker code path is identical under unison, torchrun, SLURM and mpirun.

Start method (`unison.distributed.start`): a fork server that imported torch once, or, for the ``unison`` command
on a machine without a GPU, the command's own process. Each worker gets the launcher's environment as it is at
launch.

Failure policy: the parent polls its children. When one exits non-zero or is killed,
the others are ended (SIGTERM, then SIGKILL after a grace period; SIGINT after a Ctrl-C) and `WorkerFailure` is
raised naming the first failing rank and its cause (the worker's exception, sent back
through its pipe, or the signal that killed it); its exit code is that of the worker's own
`UnisonError` (`unison.errors`). On success `launch` returns each rank's return value, sent
back through the same pipe. Children ask the kernel to kill them if the parent dies
(PR_SET_PDEATHSIG), and end themselves the moment the launcher is gone (`unison.distributed.signals.die_with_launcher`: their result
pipe loses its reader), so no orphan trains on after a killed launcher, and nothing is left on disk
(results and errors travel through pipes, not files).

Signals: SIGTERM and SIGUSR1 received by the launcher (a cluster's preemption notice) are
forwarded to every worker once its stop handlers are installed, also one started after the signal
(`unison.distributed.signals.ForwardStopSignals`); the workers finish their step, checkpoint and exit
75, and the launcher raises `Preempted` with rank 0's message. SIGINT (Ctrl-C) ends the workers promptly.

Watchdog: the workers publish heartbeats (phase, step, time) in a table shared with the
launcher (`unison.distributed.watchdog`); when no rank has made progress for
``cfg.watchdog_s`` seconds (hung collective, SIGSTOPped or frozen workers, a blocked loader)
the launcher kills them all and raises `WatchdogTimeout` naming every rank's phase and step.

A worker that re-ran the user's script (no ``if __name__ == "__main__":``) is one `ConfigError` naming the guard
(`unison.distributed.start.refuse_reentered_main`).

Hand-written rather than `torch.multiprocessing.spawn` because we need the error text of
the *first* failure, the bounded shutdown, the death signal, signal forwarding and the watchdog.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

from unison.config.distributed import DistributedConfig
from unison.config.fields import shown
from unison.errors import ConfigError, Preempted, WatchdogTimeout, WorkerFailure, exit_code_of, one_line_warnings

from . import watchdog
from .env import exit_worker
from .signals import (
    ForwardStopSignals,
    die_with_launcher,
    die_with_parent,
    install_stop_handlers,
    stop_signals_blocked,
    unblock_stop_signals,
)
from .start import (
    REENTERED_MAIN_EXIT,
    WORKER_NAME,
    LauncherStream,
    reentered_main_message,
    release_fork_server,
    start_context,
)


def find_free_port(addr: str = "127.0.0.1") -> int:
    """A free TCP port on `addr`, which must be an address of this machine (its workers serve the rendezvous
    there); `ConfigError` otherwise, before any worker starts."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return s.getsockname()[1]
    except (OSError, UnicodeError) as exc:   # gaierror (unknown host), EADDRNOTAVAIL (another machine's address)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"--master-addr {shown(addr)} is not an address of this machine ({reason}); unison starts "
                          "its workers here: leave the default 127.0.0.1, or give this machine's own address") from None


def _worker_main(target: Callable[[Any], Any], payload: Any, env: dict[str, str], heartbeats: Any,
                 threads: int, result_conn: Any, streams: tuple[Any, ...] = (), ready: Any = None,
                 others: tuple[Any, ...] = ()) -> None:
    # What was imported before this worker (torch: hundreds of thousands of objects, in the fork server or the
    # command it was forked from) is never garbage: kept out of every full collection (Python's own,
    # `shutdown_distributed`'s), which would otherwise walk all of them each time.
    gc.freeze()
    for conn in others:   # forked from the launcher: the other ranks' pipe ends (see `launch`)
        conn.close()
    for stream in streams:
        stream.attach()
    release_fork_server()
    die_with_parent()
    die_with_launcher(result_conn.fileno())
    one_line_warnings()
    install_stop_handlers()   # from the first instant: a forwarded SIGTERM during start-up must not kill
    unblock_stop_signals()    # blocked in the fork server: one sent to the process group meanwhile arrives now
    if ready is not None:     # the launcher forwards a stop to this worker from now on (`ForwardStopSignals`)
        ready[int(env["RANK"])] = 1
    # SIGINT is how the launcher aborts a worker at once after a Ctrl-C (`_terminate_all`): a KeyboardInterrupt,
    # whatever the disposition inherited from the fork server (a launcher started as a background job ignores it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()   # the launcher's environment at launch, not the one the fork server started with
    os.environ.update(env)
    watchdog.attach_launcher_table(heartbeats, int(env["RANK"]))
    try:
        import torch

        torch.set_num_threads(threads)
        result = target(payload)
        # Plain pickle, in-band: torch's multiprocessing pickler would pass tensors as shared-memory handles
        # that die with this process. The launcher reads while it polls, so a large result cannot block.
        result_conn.send_bytes(pickle.dumps(("result", result), protocol=pickle.HIGHEST_PROTOCOL))
        result_conn.close()
    except BaseException as exc:  # report every failure, SystemExit included
        # The launcher's SIGINT (it ends the survivors of a failed run) must not interrupt the report itself.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            exit_worker(0)
        code = exit_code_of(exc) or 1
        error = {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                 "exit_code": code, "traceback": traceback.format_exc(), "signal_name": getattr(exc, "signal_name", "")}
        try:
            result_conn.send_bytes(pickle.dumps(("error", error), protocol=pickle.HIGHEST_PROTOCOL))
            result_conn.close()
        except OSError:   # the launcher is gone
            pass
        exit_worker(code)
    exit_worker(0)


def _describe_exit(code: int | None, error: dict[str, Any] | None) -> str:
    if error is not None:
        # drop the C++ source location gloo/NCCL put first: "[.../unbound_buffer.cc:129] Timed out ..."
        message = re.sub(r"^\[[^\]]*:\d+\] ", "", error.get("message", ""))
        return f"{error.get('type')}: {message}"
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def is_comm_error(cause: str) -> bool:
    return any(k in cause for k in ("DistBackendError", "Connection", "connection", "Gloo", "gloo", "NCCL",
                                    "Timed out", "timed out", "Timeout"))


def _first_failure(procs: list[BaseProcess], errors: dict[int, dict[str, Any]]) -> WorkerFailure | None:
    """The most likely root cause among the workers that have failed so far.

    A peer that lost its partner fails too, with a communication error; prefer a worker
    killed by a signal, then one whose error is not a communication error, then the lowest rank.
    """
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if not failed:
        return None
    causes = {r: _describe_exit(code, errors.get(r)) for r, code in failed}

    def priority(item: tuple[int, int | None]) -> tuple[int, int]:
        r, code = item
        if code is not None and code < 0:
            return (0, r)
        return (2 if is_comm_error(causes[r]) else 1, r)

    r, _ = min(failed, key=priority)
    err = errors.get(r) or {}
    return WorkerFailure(r, causes[r], err.get("type"), err.get("traceback", ""), err.get("exit_code"))


def _check_watchdog(procs: list[BaseProcess], heartbeats: Any, limit_s: float) -> WatchdogTimeout | None:
    """`WatchdogTimeout` when no worker has made progress for `limit_s` seconds (the workers are then killed)."""
    if limit_s <= 0:
        return None
    beats, now = watchdog.read_table(heartbeats, len(procs)), time.monotonic()
    if any(now - since <= limit_s for _, _, since in beats):
        return None   # some rank moved recently (the cheap test first: this runs at every poll)
    stopped = [p.pid is not None and watchdog.process_stopped(p.pid) for p in procs]
    report = watchdog.stuck_report(beats, stopped, limit_s, now)
    if report is None:
        return None
    for p in procs:   # stuck in C++ or stopped: only SIGKILL ends them (a stopped process too)
        if p.is_alive():
            p.kill()
    return WatchdogTimeout(report)


def launch(target: Callable[[Any], Any], payload: Any, cfg: DistributedConfig, *,
           poll_s: float = 0.05, grace_s: float = 5.0, settle_s: float = 3.0, threads_per_worker: int | None = None,
           extra_env: dict[str, str] | None = None) -> list[Any]:
    """Run `target(payload)` in `cfg.world_size` processes; return their results by rank.

    Raises `WorkerFailure` if any worker fails, `Preempted` when the workers stopped after a
    SIGTERM/SIGUSR1 and wrote a checkpoint, `WatchdogTimeout` when none made progress for
    ``cfg.watchdog_s`` seconds.
    """
    cfg.validate()
    free = find_free_port(cfg.master_addr)   # also refuses, before any worker, an address not of this machine
    port = cfg.master_port or free
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // cfg.world_size)
    ctx = start_context(target, cfg.world_size)
    streams = (LauncherStream(1), LauncherStream(2)) if ctx.get_start_method() == "forkserver" else ()
    forked = ctx.get_start_method() == "fork"
    heartbeats = watchdog.new_table(ctx, cfg.world_size)
    ready = ctx.RawArray("b", cfg.world_size)   # rank r's stop handlers are installed
    procs: list[BaseProcess] = []
    pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.world_size)]   # (read end, write end) per rank
    results: dict[int, Any] = {}
    errors: dict[int, dict[str, Any]] = {}
    teardown = signal.SIGTERM
    try:
        with ForwardStopSignals(procs, ready) as forward:
            for r in range(cfg.world_size):
                env = {**os.environ, "UNISON_LAUNCHER_PID": str(os.getpid()),   # (a test's fault hook signals it)
                       "RANK": str(r), "WORLD_SIZE": str(cfg.world_size), "LOCAL_RANK": str(r),
                       "LOCAL_WORLD_SIZE": str(cfg.world_size), "MASTER_ADDR": cfg.master_addr,
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
                # A worker forked from here closes what it inherited of the other ranks' pipes: a copy of a read end
                # would keep a rank's pipe open after the launcher died (`die_with_launcher`), and of a write end,
                # after that rank died.
                others = tuple(c for pipe in pipes for c in pipe if c is not pipes[r][1]) if forked else ()
                p = ctx.Process(target=_worker_main, name=f"{WORKER_NAME}{r}", daemon=False,
                                args=(target, payload, env, heartbeats, threads, pipes[r][1], streams, ready, others))
                with stop_signals_blocked() if forked else contextlib.nullcontext():   # as the fork server's are
                    p.start()
                pipes[r][1].close()   # the child holds the write end; EOF then means it is gone
                procs.append(p)
            conns = [read for read, _ in pipes]
            return _supervise(procs, conns, results, errors, heartbeats, cfg, poll_s, settle_s, forward)
    except KeyboardInterrupt:
        teardown = signal.SIGINT   # Ctrl-C: the workers end at once, aborting an unfinished save
        raise
    finally:
        _terminate_all(procs, grace_s, teardown)
        for read, _ in pipes:   # after the workers ended: a closed read end kills a live worker (`die_with_launcher`)
            read.close()        # at once, before SIGINT could abort its unfinished save and remove the file


def _supervise(procs: list[BaseProcess], conns: list[Any], results: dict[int, Any], errors: dict[int, dict[str, Any]],
               heartbeats: Any, cfg: DistributedConfig, poll_s: float, settle_s: float,
               forward: ForwardStopSignals) -> list[Any]:
    """Poll the workers until all have finished or one failed; return the results or raise the failure."""
    failure: WorkerFailure | None = None
    while failure is None and any(p.is_alive() for p in procs):
        forward.deliver()   # a stop received before a worker could hear it: to each worker once it can
        _receive_results(conns, results, errors)
        failure = _first_failure(procs, errors)
        if failure is None:
            stuck = _check_watchdog(procs, heartbeats, cfg.watchdog_s)
            if stuck is not None:
                raise stuck
            time.sleep(poll_s)
    if failure is not None and (procs[failure.rank].exitcode or 0) >= 0:
        # Workers often fail together: a peer that lost its partner fails with a communication
        # error before the partner's own exit is visible, and ranks that hit the same bad input
        # fail at once. Let the others show up (ends as soon as all have exited), then report by
        # cause and lowest rank, so the report does not depend on timing. A kill needs no wait.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(poll_s)
        _receive_results(conns, results, errors)
        failure = _first_failure(procs, errors) or failure
    if failure is not None and is_comm_error(failure.cause):
        silent = [str(r) for r, p in enumerate(procs) if p.is_alive() and r != failure.rank]
        if silent:  # a peer that neither failed nor answered: hung (the collective timed out, --timeout-s)
            failure.cause += f" (rank {', '.join(silent)} did not fail but stopped responding)"
            failure.args = (f"worker rank {failure.rank} failed: {failure.cause}",)
    if failure is None:
        for p in procs:
            p.join()
        _receive_results(conns, results, errors)
        failure = _first_failure(procs, errors)
    if failure is not None and failure.error_type is None and procs[failure.rank].exitcode == REENTERED_MAIN_EXIT:
        raise ConfigError(reentered_main_message("the call that started the workers (unison.train, unison.check)"))
    if failure is not None and failure.error_type == "Preempted":
        # every rank stopped after the same step; rank 0 wrote
        raise Preempted(errors[failure.rank]["message"], signal_name=errors[failure.rank].get("signal_name", ""))
    if failure is not None and _interrupted(failure, procs[failure.rank].exitcode):
        # SIGINT that reached the workers but not this process: sent to a background job's process group (whose
        # shell made it ignore SIGINT), or to a worker by pid. The run was interrupted, as by Ctrl-C, not failed.
        raise KeyboardInterrupt(f"rank {failure.rank} received SIGINT")
    if failure is not None:
        raise failure
    return [results.get(r) for r in range(cfg.world_size)]


def _interrupted(failure: WorkerFailure, exitcode: int | None) -> bool:
    """The first failure is a worker's KeyboardInterrupt (or death by SIGINT), not an error of the run."""
    return failure.error_type == "KeyboardInterrupt" or exitcode == -signal.SIGINT


def _receive_results(conns: list[Any], results: dict[int, Any], errors: dict[int, dict[str, Any]]) -> None:
    """Take each worker's result or error off its pipe (EOF without either: it was killed or returned nothing)."""
    for r, conn in enumerate(conns):
        if r in results or r in errors or conn.closed:
            continue
        try:
            if conn.poll():
                kind, value = pickle.loads(conn.recv_bytes())
                (results if kind == "result" else errors)[r] = value
        except (EOFError, OSError):
            results[r] = None


def _terminate_all(procs: list[BaseProcess], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """End every live worker with `sig`, SIGKILL after `grace_s`.

    After a failure: SIGTERM, a stop request; a survivor cannot write a new checkpoint without its peers, so it
    fails at its next collective and on its way out lets a checkpoint still being written in the background
    complete. After Ctrl-C: SIGINT (KeyboardInterrupt: an unfinished save is aborted and its file removed).
    """
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
