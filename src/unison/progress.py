"""Progress of a long phase, as lines on standard error: ``unison: WHAT done/total images (N s)``.

A phase shorter than `PROGRESS_AFTER_S` shows nothing; a longer one a line at most every `PROGRESS_EVERY_S`
seconds and a last one when it ends. Plain lines, not a bar: they read the same in a terminal, a log file
and a cluster's output, and several processes cannot garble them. Used where a phase's length grows with
the data: decoding a data set into memory, embedding kNN sets, ``unison eval`` and ``unison embed``.

`Stages` is the other kind: a command that works through a few long stages of unknown length (``unison plan``'s
simulated steps) says each as it starts and, while one runs, ``still ...`` every `STILL_EVERY_S` seconds, so it is
never silent for long; it is torch-free, so the first line comes before torch is imported.

Example::

    progress = Progress("kNN: embedding the reference set", total=5000)
    for done in range(0, 5000, 512):
        ...
        progress(min(done + 512, 5000))
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PROGRESS_AFTER_S", "PROGRESS_EVERY_S", "STILL_EVERY_S", "Progress", "Stages"]

PROGRESS_AFTER_S = 3.0    # a phase shorter than this shows nothing
PROGRESS_EVERY_S = 10.0   # then one line at most this often
STILL_EVERY_S = 10.0      # `Stages`: a line this often while a stage runs


class Progress:
    """``done/total`` of a phase on standard error: the first line after `PROGRESS_AFTER_S`, then at most every
    `PROGRESS_EVERY_S`, and a last one when it ends (if any was shown). `total` counts rank 0's share
    when the phase is split over ranks (`of` says of how many in all)."""

    def __init__(self, what: str, total: int, of: int | None = None, show: bool = True):
        self.what, self.total, self.of, self.show = what, total, of, show and total > 0
        self.start = self.last = time.monotonic()
        self.shown = False

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if not self.show or now - self.start < PROGRESS_AFTER_S:
            return
        if done < self.total and self.shown and now - self.last < PROGRESS_EVERY_S:
            return
        if done >= self.total and not self.shown:
            return   # ended before the first line was due
        share = f" (rank 0's share of {self.of:,})" if self.of and self.of != self.total else ""
        print(f"unison: {self.what} {done:,}/{self.total:,} images{share} ({now - self.start:.0f} s)",
              file=sys.stderr, flush=True)
        self.shown, self.last = True, now


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Stages:
    """``NAME: [N s] STAGE`` as each stage starts, and ``still STAGE`` every `every_s` while it runs (a thread)."""

    def __init__(self, name: str, write: Callable[[str], None] | None = None, every_s: float = STILL_EVERY_S) -> None:
        self.name, self.write, self.every_s = name, write or _to_stderr, every_s
        self._started = time.monotonic()
        self._stage, self._next = "", 0.0   # the stage running, and when its next "still" line is due
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._still, name=f"{name} progress", daemon=True)

    def __enter__(self) -> Stages:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def stage(self, text: str) -> None:
        with self._lock:
            self._stage, self._next = text, time.monotonic() + self.every_s
            self._line(text)

    def _line(self, text: str) -> None:
        self.write(f"{self.name}: [{time.monotonic() - self._started:.0f} s] {text}")

    def _still(self) -> None:
        while not self._done.wait(max(0.01, min(self.every_s, self._next - time.monotonic()))):
            with self._lock:
                if self._stage and time.monotonic() >= self._next:
                    self._line(f"still {self._stage}")
                    self._next = time.monotonic() + self.every_s
