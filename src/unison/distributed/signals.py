"""Stop requests: SIGTERM and SIGUSR1 are recorded, not obeyed on the spot.

Clusters ask a job to stop before they kill it: SLURM sends SIGTERM at preemption or
``scancel`` (and SIGUSR1 ahead of the time limit with ``#SBATCH --signal=USR1@120``),
Kubernetes sends SIGTERM at pod eviction, torchrun forwards the signal it receives to its
workers. Python's default for SIGTERM is to die at once, losing every step since the last
checkpoint. `install_stop_handlers()` replaces it with a handler that only records the
request; the training loop finishes its current step, agrees with the other ranks, writes a
checkpoint and exits with `unison.errors.PREEMPTED_EXIT_CODE` (`unison.training.preemption`).

A second signal during the save is recorded and otherwise ignored, so the save completes (a
kill that follows still leaves the previous checkpoint intact: saves are atomic). SIGINT
(Ctrl-C) is not a stop request: it raises KeyboardInterrupt as usual and ends the run
promptly, aborting an unfinished save.

Install as early as possible in a worker (before the slow imports), so a signal that arrives
during start-up is not fatal. Handlers can only be installed from the main thread; elsewhere
the call does nothing. This module imports nothing heavy.

`ForwardStopSignals`: unison's launcher passes a stop on to each worker once that worker can hear it;
`stop_signals_blocked` keeps multiprocessing's fork server alive through a stop sent to the whole process group.

`die_with_parent()` (Linux): a child process asks the kernel to SIGKILL it when its parent dies, so no
worker, data-loader process or (through them) multiprocessing's resource tracker outlives a killed run;
`die_with_launcher()`: a worker of unison's launcher (a child of its fork server) ends the moment the launcher does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


@dataclass
class StopRequests:
    """What this process has been asked: the first stop signal received and how many arrived."""

    first: int | None = None
    count: int = 0
    previous: dict[int, object] = field(default_factory=dict)
    handovers: int = 0   # times training took over the stop signals in this process (`stop_handovers`)

    @property
    def requested(self) -> bool:
        return self.first is not None

    def name(self) -> str:
        return signal.Signals(self.first).name if self.first is not None else ""

    def _on_signal(self, signum: int, frame: object) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.first is None:
            self.first = signum
            _note(f"{name} received (t={time.time():.3f}): finishing the current step, then saving a checkpoint")
        else:  # a second signal (e.g. during the save) must not interrupt it: the save is what makes stopping safe
            _note(f"{name} again: still finishing the step and the checkpoint")


_REQUESTS = StopRequests()


class _StopSignal(BaseException):
    """What `stop_signals_raise`'s handler raises: a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` it lands in (a decode, a header probe, a library's retry) can swallow it. The block
    turns it into the caller's error as it leaves."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@contextlib.contextmanager
def stop_signals_raise(error: Callable[[str], BaseException]) -> Iterator[None]:
    """Within the block, SIGTERM/SIGUSR1 raise ``error(signal name)`` in the main thread, so the caller's cleanup
    runs and the user gets one line (Python's default ends the process at once, exit 143, leaving partial files).
    Outside the main thread (where no handler can be set) nothing changes."""
    before = _REQUESTS.first, _REQUESTS.count
    fired: list[int] = []

    def stop(signum: int, frame: object) -> None:
        # recorded too: where code catches BaseException and goes on, the loops that check `stop_requests()`
        # still stop at their next step
        fired.append(signum)
        _REQUESTS.count += 1
        _REQUESTS.first = signum if _REQUESTS.first is None else _REQUESTS.first
        raise _StopSignal(signal.Signals(signum).name)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    except _StopSignal as stopped:
        raise error(stopped.name) from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if fired:   # this block's stop is handled: what it recorded does not outlive it
            _REQUESTS.first, _REQUESTS.count = before


class ForwardStopSignals:
    """While active (main thread only): SIGTERM/SIGUSR1 to unison's launcher go on to every live worker, each
    once its own stop handlers are installed (``ready[rank]`` set by the worker): a worker signalled before that
    would die of it, and one started after the signal would never hear it (a SIGTERM in a run's first seconds
    would be lost, and the run train on). `deliver()` sends a received stop to the workers that have
    become ready since; the launcher calls it at every poll."""

    def __init__(self, procs: list[Any], ready: Any) -> None:
        self.procs, self.ready = procs, ready
        self.received: int | None = None
        self.told: set[int] = set()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> ForwardStopSignals:
        _REQUESTS.handovers += 1
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def _forward(self, signum: int, frame: Any) -> None:
        if self.received is None:
            os.write(2, f"unison: {signal.Signals(signum).name}: asking every worker to finish its step and save a "
                        "checkpoint\n".encode())
        self.received = signum
        self.told.clear()   # every signal goes to every ready worker (a second one too)
        self.deliver()

    def deliver(self) -> None:
        if self.received is None:
            return
        for rank, p in enumerate(list(self.procs)):
            if rank in self.told or not self.ready[rank] or not p.is_alive() or p.pid is None:
                continue
            self.told.add(rank)
            try:
                os.kill(p.pid, self.received)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGTERM/SIGUSR1 blocked in this thread within the block (not lost: a pending one arrives at its end).

    For starting multiprocessing's fork server: a process started meanwhile inherits the mask across fork and
    exec, so the server never dies of a stop sent to the whole process group (SLURM's ``scancel``, ``timeout``,
    a shell's job control). Were it to die, its workers' exit codes would be lost (multiprocessing reports 255),
    and a run that stopped cleanly, checkpoint written, would end as "worker rank 0 failed: exited with code 255".
    The workers it forks inherit the mask too, and unblock once their handlers are installed
    (`unblock_stop_signals`)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def unblock_stop_signals() -> None:
    """Undo an inherited `stop_signals_blocked` (after `install_stop_handlers`: a pending stop is recorded)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _note(text: str) -> None:
    # os.write, not sys.stderr: the handler may run while the main thread is inside a stderr write.
    rank = os.environ.get("RANK")
    try:
        os.write(2, f"unison: {'rank ' + rank + ': ' if rank is not None else ''}{text}\n".encode())
    except OSError:
        pass


def stop_handovers() -> int:
    """How many times training has taken over SIGTERM/SIGUSR1 in this process so far: a worker's loop
    (`install_stop_handlers`) or unison's launcher (`ForwardStopSignals`). A `stop_signals_raise` block that sees
    the count grow knows that training began inside it, whatever handler is back in place when the signal comes
    (the loop restores the block's when it ends, after its last checkpoint, or while it fails)."""
    return _REQUESTS.handovers


def install_stop_handlers() -> StopRequests:
    """Record SIGTERM/SIGUSR1 from now on (idempotent); return the process-wide `StopRequests`."""
    _REQUESTS.handovers += 1
    if threading.current_thread() is not threading.main_thread():
        return _REQUESTS
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current != _REQUESTS._on_signal:
            _REQUESTS.previous.setdefault(sig, current)
            signal.signal(sig, _REQUESTS._on_signal)
    return _REQUESTS


def stop_requests() -> StopRequests:
    """The process-wide record (whether or not the handlers are installed)."""
    return _REQUESTS


def restore_default_handlers() -> None:
    """Put back what `install_stop_handlers` replaced and forget recorded requests (tests, in-process runs)."""
    if threading.current_thread() is threading.main_thread():
        for sig, old in _REQUESTS.previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)  # type: ignore[arg-type]
    _REQUESTS.previous.clear()
    _REQUESTS.first, _REQUESTS.count = None, 0


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: deliver SIGKILL to this process when its parent exits (PR_SET_PDEATHSIG). `parent_pid`: the parent
    this process was started by; if it is already gone (it died before the request was made), die now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher(result_fd: int) -> None:
    """A worker of unison's launcher: SIGKILL this process (as PR_SET_PDEATHSIG does) the moment the launcher is
    gone. `result_fd`: the write end of the pipe whose only read end the launcher holds.

    Why not PR_SET_PDEATHSIG alone: a worker's parent is the fork server, which exits when the launcher dies but
    only after its own teardown (seconds, with torch imported), in which an orphaned worker would train on and
    write checkpoints. When the launcher dies the pipe has no reader, and its write end reports POLLERR: a daemon thread
    waits for exactly that (blocked in poll: no cost), on its own copy of the write end, open until this exits."""
    import select

    if not hasattr(select, "poll"):
        return
    poller = select.poll()
    fd = os.dup(result_fd)
    poller.register(fd, select.POLLERR)   # (POLLERR and POLLHUP are always reported; nothing else is asked for)

    def wait() -> None:
        while True:
            events = [event for _, event in poller.poll()]
            if any(event & select.POLLNVAL for event in events):
                return   # (never: the copy is not closed)
            if any(event & (select.POLLERR | select.POLLHUP) for event in events):
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="unison-launcher-alive", daemon=True).start()
