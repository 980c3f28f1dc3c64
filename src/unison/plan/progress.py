"""What `unison plan` is doing, as lines on standard error while it works.

A plan runs several simulated steps (its configuration, then twice the local batch, then the GPU code path), each
from a second to minutes: large models, many micro-batches and large world sizes cost more (each collective
of a simulated W-rank job handles W fake tensors). `PlanProgress` prints a line as each stage starts and, while
one runs, a line every `STILL_EVERY_S` seconds, so the command is never silent for long. Plain lines on standard
error (standard output keeps the report, and ``--json`` stays one object), as `unison.progress` prints them.

Example::

    with PlanProgress() as progress:
        progress.stage("simulating one step at local batch 64")
        ...
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["STILL_EVERY_S", "PlanProgress"]

STILL_EVERY_S = 15.0


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class PlanProgress:
    """``unison plan: [N s] STAGE`` as each stage starts, and ``still STAGE`` every `every_s` while it runs."""

    def __init__(self, write: Callable[[str], None] = _to_stderr, every_s: float = STILL_EVERY_S) -> None:
        self.write, self.every_s = write, every_s
        self._started = time.monotonic()
        self._stage = ""
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._still, name="unison-plan-progress", daemon=True)

    def __enter__(self) -> PlanProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def stage(self, text: str) -> None:
        with self._lock:
            self._stage = text
            self._line(text)

    def _line(self, text: str) -> None:
        self.write(f"unison plan: [{time.monotonic() - self._started:.0f} s] {text}")

    def _still(self) -> None:
        while not self._done.wait(self.every_s):
            with self._lock:
                if self._stage:
                    self._line(f"still {self._stage}")
