"""Deadlock watchdog: a run in which no rank makes progress ends after ``--watchdog-s`` seconds.

Every worker keeps a heartbeat: the phase it is in and when it entered it. Phases:

====================  =====================================================  =========
phase                 what the rank is doing                                 watched
====================  =====================================================  =========
``startup``           building the run, resuming, the first training step    no
``read``              reading data outside the batches' loader processes:    yes
                      an image file, a shard member, an item of your
                      dataset (the image-size probe, the channel statistics,
                      the kNN sets, the signals' and the probe's held-back
                      images, an in-memory decode; in evaluations too)
``data``              waiting for its next batch (the first one too)         yes
``step``              forward, backward (DDP's gradient all-reduce), update  yes
``collective``        a collective of the loop (stop agreement, metrics)     yes
``checkpoint``        collecting or writing a checkpoint                     yes
``eval``              kNN evaluation                                         no
``done``              finished training                                      no
====================  =====================================================  =========

A phase that takes longer than ``--watchdog-s`` seconds on every rank means the run is stuck:
a collective that never completes (a peer died silently or waits elsewhere), a worker that is
frozen or SIGSTOPped, a data loader or a dataset item that blocks (the first batch too: one worker
has no collective timeout). Start-up (the build, which includes the first step, where
``torch.compile`` runs) and evaluation can be legitimately long and are not watched, but every read of data
in them is (`reading`, around the one read of a catalogued sample and of an item of your dataset): the rank is in
``read`` while one is in flight, and each read that ends is progress, so a long decode of many images is not
stuck and one read that never returns is. ``--timeout-s`` (torch's own collective timeout) still applies to the
rest. Before any worker starts, the launching process's own look at the data (listing it, reading its first images
or your dataset's first items, which the workers' build reads again) is watched by `watched_startup`, with the same
limit.

Who watches:

* **unison's launcher** (`unison.distributed.launch`) shares a table of heartbeats with its
  workers (shared memory) and checks it while it polls them. It sees every rank, also when all
  of them are SIGSTOPped (no thread in a stopped process runs), and ends the run with one line
  naming each rank, its phase and step, and whether it is stopped.
* **Any other launcher** (torchrun, srun, mpirun): a daemon thread in each worker watches its
  own heartbeat; when it fires it prints the rank, phase and step and ends the process with
  exit code 1, so its peers fail too and the launcher (torchrun ``--max-restarts``) takes over.
* **No launcher** (one worker, training in the caller's process: a notebook, a script, ``unison train
  --world-size 1``): the same thread, but the process is the caller's, and ending it would end a notebook's kernel.
  It raises `Stuck` in the thread that trains instead (`CallerInterrupt`), which `unison.training` turns into a
  `WatchdogTimeout` naming the phase; `watched_startup` does the same. Only a thread blocked where Python cannot
  interrupt it (C code that retries on signals) is still ended with the process, after a further ``--watchdog-s``.

Example::

    watch = Watchdog(rank, limit_s=cfg.distributed.watchdog_s)
    for batch in watch.data(batches(run, step)):     # phase "data" while the next batch is produced
        with watch.phase("step", batch.step):
            ...
    watch.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from unison.errors import WatchdogTimeout

PHASES = ("startup", "data", "step", "collective", "checkpoint", "eval", "done", "read")
WATCHED = frozenset({"read", "data", "step", "collective", "checkpoint"})
WATCHED_FROM_THE_FIRST = frozenset({"read", "data"})   # nothing legitimate is slow there: watched before the first step
INTERRUPT = signal.SIGUSR2   # what wakes the caller's blocked thread (SIGTERM/SIGUSR1 are stop requests)
SLOT = 3   # per rank in the shared table: phase index, step, time.monotonic() when the phase was entered

_launcher_table: tuple[Any, int] | None = None   # (shared array, rank), set in a worker of unison's launcher


def attach_launcher_table(table: Any, rank: int) -> None:
    """Called by unison's launcher in each worker: heartbeats go to the launcher's shared table."""
    global _launcher_table
    _launcher_table = (table, rank)


def new_table(ctx: Any, world_size: int) -> Any:
    """The launcher's shared heartbeat table (a multiprocessing RawArray of doubles), every rank in start-up."""
    table = ctx.RawArray("d", SLOT * world_size)
    now = time.monotonic()
    for r in range(world_size):
        table[SLOT * r: SLOT * r + SLOT] = [0.0, -1.0, now]
    return table


def read_table(table: Any, world_size: int) -> list[tuple[str, int, float]]:
    """(phase, step, monotonic time entered) of every rank."""
    out = []
    for r in range(world_size):
        code, step, since = table[SLOT * r: SLOT * r + SLOT]
        out.append((PHASES[int(code)] if 0 <= int(code) < len(PHASES) else "startup", int(step), float(since)))
    return out


def process_stopped(pid: int) -> bool:
    """True when `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): Linux /proc; False where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stuck_report(beats: list[tuple[str, int, float]], stopped: list[bool], limit_s: float,
                 now: float | None = None) -> str | None:
    """The message when no rank made progress for `limit_s` seconds, else None.

    A rank makes no progress when it has been in a watched phase, or stopped, for longer than
    the limit; one rank in an unwatched phase (start-up, evaluation) keeps the run alive.
    """
    if limit_s <= 0:
        return None
    now = time.monotonic() if now is None else now
    for (phase, _, since), is_stopped in zip(beats, stopped):
        if now - since <= limit_s or not (phase in WATCHED or is_stopped):
            return None
    ranks = []
    for r, ((phase, step, since), is_stopped) in enumerate(zip(beats, stopped)):
        state = "stopped (SIGSTOP) " if is_stopped else ""
        ranks.append(f"rank {r} {state}{where(phase, step)} for {now - since:.0f} s")
    return f"watchdog: no rank made progress for {limit_s:g} s (--watchdog-s): {'; '.join(ranks)}"


def where(phase: str, step: int) -> str:
    """``in step at step 3``; ``in read before the first step`` (what a rank is doing, for messages)."""
    what = "read (of an image or an item of your dataset)" if phase == "read" else phase
    return f"in {what} at step {step}" if step >= 0 else f"in {what} before the first step"


class Watchdog:
    """This rank's heartbeat, and (outside unison's launcher) the thread that watches it.

    `in_caller`: this process is the caller's own (one worker, no launcher): a stuck run raises `Stuck` in the thread
    that made the watchdog instead of ending the process (`CallerInterrupt`)."""

    def __init__(self, rank: int, limit_s: float, *, poll_s: float = 1.0, in_caller: bool = False) -> None:
        global _current
        self.rank, self.limit_s = rank, float(limit_s)
        self._phase, self._step, self._since, self._armed = "startup", -1, time.monotonic(), False
        self._table = _launcher_table[0] if _launcher_table is not None and _launcher_table[1] == rank else None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._reads, self._before_read, self._lock = 0, ("startup", -1), threading.Lock()
        self._pid = os.getpid()   # a forked loader process inherits this object: its reads are not this rank's
        self.interrupt = CallerInterrupt() if in_caller and self._table is None and self.limit_s > 0 else None
        self._publish()
        if self._table is None and self.limit_s > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="unison-watchdog", daemon=True)
            self._thread.start()
        _current = self

    # ------------------------------------------------------------------ heartbeat
    def enter(self, phase: str, step: int) -> None:
        if not self._armed and phase in WATCHED and phase not in WATCHED_FROM_THE_FIRST:   # the first step: start-up
            phase = "startup"   # (compile); waiting for a batch and reading data are watched from the first
        self._phase, self._step, self._since = phase, step, time.monotonic()
        self._publish()

    def _publish(self) -> None:
        if self._table is not None:
            at = SLOT * self.rank
            self._table[at: at + SLOT] = [float(PHASES.index(self._phase)), float(self._step), self._since]

    @contextlib.contextmanager
    def phase(self, phase: str, step: int) -> Iterator[None]:
        """`phase` for the duration of the block; the previous phase (with a fresh time) afterwards."""
        before = self._phase
        self.enter(phase, step)
        try:
            yield
        finally:
            self.enter(before, step)

    def data(self, micro_batches: Iterator[Any], start_step: int = 0) -> Iterator[Any]:
        """Pass `micro_batches` through, in phase "data" while each is produced, "step" once it is there.

        The step a "data" phase reports is the one whose batch is awaited: the last batch's step, or the
        step the loop's hooks entered after it (`phase(..., step)` with the number of completed steps).
        """
        self._step = max(self._step, start_step)
        while True:
            self.enter("data", self._step)
            try:
                batch = next(micro_batches)
            except StopIteration:
                return
            self.enter("step", getattr(batch, "step", self._step))
            yield batch

    def read_started(self) -> None:
        """A read of data begins (`reading`; any thread of this process): phase "read" while one is in flight."""
        with self._lock:
            if self._reads == 0:
                self._before_read = (self._phase, self._step)
                self.enter("read", self._step)
            self._reads += 1

    def read_ended(self) -> None:
        """A read ended: progress; the phase before the reads once none is in flight."""
        with self._lock:
            self._reads -= 1
            if self._reads == 0:
                self.enter(*self._before_read)
            else:
                self._since = time.monotonic()
                self._publish()

    def arm(self) -> None:
        """The first step has completed (start-up, compile included, is not watched): watch every phase now."""
        self._armed = True

    def close(self) -> None:
        global _current
        self.enter("done", self._step)
        self._closed.set()
        if self.interrupt is not None:
            self.interrupt.close()
        if _current is self:
            _current = None

    @property
    def stuck(self) -> str | None:
        """The message of the in-caller interrupt, once it fired (what `Stuck` was raised for)."""
        return self.interrupt.message if self.interrupt is not None else None

    # ------------------------------------------------------------------ the in-process watcher
    def _watch(self, poll_s: float) -> None:
        while not self._closed.wait(poll_s):
            phase, step, since = self._phase, self._step, self._since
            if phase in WATCHED and time.monotonic() - since > self.limit_s:
                if self.interrupt is None:
                    _end_process(f"watchdog: rank {self.rank} made no progress for {self.limit_s:g} s "
                                 f"(--watchdog-s) {where(phase, step)}; ending this worker")
                self.interrupt.fire(f"watchdog: no progress for {self.limit_s:g} s (--watchdog-s) "
                                    f"{where(phase, step)}; the run was ended", self._closed, self.limit_s)
                return


_current: Watchdog | None = None   # this process's run's watchdog, which `reading` reports to


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """Around one read of data (a catalogued sample's bytes, an item of your dataset): the rank is in phase "read"
    while it is in flight and its end is progress, so a read that never returns ends the run within ``--watchdog-s``
    whatever phase it happens in (the build, an evaluation). Nothing outside a run's process (a loader process
    forked from it, ``unison eval``, the pre-flight before the run's watchdog exists)."""
    watch = _current
    if watch is None or watch.limit_s <= 0 or watch._pid != os.getpid():
        yield
        return
    watch.read_started()
    try:
        yield
    finally:
        watch.read_ended()


class Stuck(BaseException):
    """Raised by `CallerInterrupt` in the thread it watches. A BaseException, as KeyboardInterrupt is: the
    ``except Exception`` around a user's dataset item or a decode must not take it for a bad image."""


class CallerInterrupt:
    """Interrupt the thread that made this object (the caller's, training in its own process) when it is stuck: the
    main thread by a signal (`INTERRUPT`) whose handler raises `Stuck`, which also ends a blocking sleep, lock or read;
    another thread by an asynchronous exception (raised at its next Python instruction). If the thread has not
    left the stuck call within `grace_s` after that, the process ends as a launched worker's does."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.message: str | None = None
        self._previous: Any = None
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            self._previous = signal.signal(INTERRUPT, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.message is not None:
            raise Stuck(self.message)

    def fire(self, message: str, done: threading.Event, grace_s: float) -> None:
        """Called from the watching thread: raise `Stuck` in the watched one; end the process if that does not
        end the stuck call (`done` is set when the caller has left it) within `grace_s`."""
        self.message = message
        if self._main:
            signal.pthread_kill(self.thread, INTERRUPT)
        else:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), ctypes.py_object(Stuck))
        if not done.wait(max(grace_s, 1.0)):
            _end_process(f"{message}, and the call blocked did not return within {max(grace_s, 1.0):g} s after "
                         "being interrupted; ending this process")

    def close(self) -> None:
        if self._main and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT, self._previous if self._previous is not None else signal.SIG_DFL)


def _end_process(message: str) -> NoReturn:
    try:
        os.write(2, f"unison: error: {message}\n".encode())
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)   # the main thread is blocked (in C++ or in the user's code): nothing else can end this process


@contextlib.contextmanager
def watched_startup(limit_s: float, what: str) -> Iterator[None]:
    """The launching process's own start-up (`what`: e.g. the pre-flight's reading of the data), which must end
    within `limit_s` seconds (``--watchdog-s``; 0: not watched), else `WatchdogTimeout` in the caller (one line): a
    dataset item that blocks, a data folder on a hung filesystem, before any worker (or its watchdog) exists. The
    process is the caller's (a notebook's kernel): it goes on (`CallerInterrupt`)."""
    if limit_s <= 0:
        yield
        return
    done = threading.Event()
    interrupt = CallerInterrupt()

    def watch() -> None:
        if not done.wait(limit_s):
            interrupt.fire(f"watchdog: no progress for {limit_s:g} s (--watchdog-s) while {what}; the run was not "
                           "started (a dataset item or a file read that blocks?)", done, limit_s)

    threading.Thread(target=watch, name="unison-startup-watchdog", daemon=True).start()
    try:
        yield
    except Stuck:
        raise WatchdogTimeout(str(interrupt.message)) from None
    finally:
        done.set()
        interrupt.close()
