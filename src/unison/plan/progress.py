"""What `unison plan` is doing, as lines on standard error while it works (`unison.progress.Stages`).

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

from collections.abc import Callable

from unison.progress import STILL_EVERY_S, Stages

__all__ = ["STILL_EVERY_S", "PlanProgress"]


class PlanProgress(Stages):
    """``unison plan: [N s] STAGE`` as each stage starts, and ``still STAGE`` every `every_s` while it runs."""

    def __init__(self, write: Callable[[str], None] | None = None, every_s: float = STILL_EVERY_S) -> None:
        super().__init__("unison plan", write, every_s)
