"""Deadlock watchdog: a run in which no rank makes progress ends after ``--watchdog-s`` seconds.

Every worker keeps a heartbeat: the phase it is in and when it entered it. Phases:

====================  =====================================================  =========
phase                 what the rank is doing                                 watched
====================  =====================================================  =========
``startup``           building the run, resuming, the first training step    no
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
``torch.compile`` runs) and evaluation can be legitimately long and are not watched; there
``--timeout-s`` (torch's own collective timeout) still applies. Before any worker starts, the
launching process's own look at the data (listing it, reading its first images or your dataset's
first items, which the workers' build reads again) is watched by `watched_startup`, with the same limit.

Who watches:

* **unison's launcher** (`unison.distributed.launch`) shares a table of heartbeats with its
  workers (shared memory) and checks it while it polls them. It sees every rank, also when all
  of them are SIGSTOPped (no thread in a stopped process runs), and ends the run with one line
  naming each rank, its phase and step, and whether it is stopped.
* **Any other launcher** (torchrun, srun, mpirun): a daemon thread in each worker watches its
  own heartbeat; when it fires it prints the rank, phase and step and ends the process with
  exit code 1, so its peers fail too and the launcher (torchrun ``--max-restarts``) takes over.

Example::

    watch = Watchdog(rank, limit_s=cfg.distributed.watchdog_s)
    for batch in watch.data(batches(run, step)):     # phase "data" while the next batch is produced
        with watch.phase("step", batch.step):
            ...
    watch.close()
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

PHASES = ("startup", "data", "step", "collective", "checkpoint", "eval", "done")
WATCHED = frozenset({"data", "step", "collective", "checkpoint"})
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
        ranks.append(f"rank {r} {state}in {phase} at step {step} for {now - since:.0f} s")
    return f"watchdog: no rank made progress for {limit_s:g} s (--watchdog-s): {'; '.join(ranks)}"


class Watchdog:
    """This rank's heartbeat, and (outside unison's launcher) the thread that watches it."""

    def __init__(self, rank: int, limit_s: float, *, poll_s: float = 1.0) -> None:
        self.rank, self.limit_s = rank, float(limit_s)
        self._phase, self._step, self._since, self._armed = "startup", -1, time.monotonic(), False
        self._table = _launcher_table[0] if _launcher_table is not None and _launcher_table[1] == rank else None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish()
        if self._table is None and self.limit_s > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="unison-watchdog", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ heartbeat
    def enter(self, phase: str, step: int) -> None:
        if not self._armed and phase in WATCHED and phase != "data":   # the first step: start-up (compile)
            phase = "startup"   # (waiting for a batch is watched from the first: nothing legitimate is slow there)
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

    def arm(self) -> None:
        """The first step has completed (start-up, compile included, is not watched): watch every phase now."""
        self._armed = True

    def close(self) -> None:
        self.enter("done", self._step)
        self._closed.set()

    # ------------------------------------------------------------------ the in-process watcher
    def _watch(self, poll_s: float) -> None:
        while not self._closed.wait(poll_s):
            phase, step, since = self._phase, self._step, self._since
            if phase in WATCHED and time.monotonic() - since > self.limit_s:
                _end_process(f"watchdog: rank {self.rank} made no progress for {self.limit_s:g} s (--watchdog-s) "
                             f"in {phase} at step {step}; ending this worker")


def _end_process(message: str) -> None:
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
    within `limit_s` seconds (``--watchdog-s``; 0: not watched), else one line and exit 1: a dataset item that
    blocks, a data folder on a hung filesystem, before any worker (or its watchdog) exists."""
    if limit_s <= 0:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if not done.wait(limit_s):
            _end_process(f"watchdog: no progress for {limit_s:g} s (--watchdog-s) while {what}; ending the run "
                         "(a dataset item or a file read that blocks?)")

    threading.Thread(target=watch, name="unison-startup-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()
