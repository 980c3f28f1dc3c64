"""Progress of a long phase, as lines on standard error: ``unison: WHAT done/total images (N s)``.

A phase shorter than `PROGRESS_AFTER_S` shows nothing; a longer one a line at most every `PROGRESS_EVERY_S`
seconds and a last one when it ends. Plain lines, not a bar: they read the same in a terminal, a log file
and a cluster's output, and several processes cannot garble them. Used where a phase's length grows with
the data: decoding a data set into memory, embedding kNN sets, ``unison eval`` and ``unison embed``.

Example::

    progress = Progress("kNN: embedding the reference set", total=5000)
    for done in range(0, 5000, 512):
        ...
        progress(min(done + 512, 5000))
"""

from __future__ import annotations

import sys
import time

__all__ = ["PROGRESS_AFTER_S", "PROGRESS_EVERY_S", "Progress"]

PROGRESS_AFTER_S = 3.0    # a phase shorter than this shows nothing
PROGRESS_EVERY_S = 10.0   # then one line at most this often


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
