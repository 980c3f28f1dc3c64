"""Rank 0's checkpoint writer: the step loop waits only for a snapshot, a thread writes the file.

A synchronous save stalls every rank for the whole serialisation, fsync and rename (rank 0
writes, the others wait at the barrier). `Checkpointer(asynchronous=True)` instead copies the
state's tensors (a consistent snapshot, taken between two steps) and hands the copy to a
background thread that calls `save_checkpoint` (atomic: temporary file, fsync, rename, fsync of
the folder). At most one save is in flight: the next save, `wait()` and `close()` wait for it.
`wait_s` holds, per save, how long the step loop was held up (the loop records it; the number
docs/reliability.md reports).

Why a thread of our own and not ``torch.distributed.checkpoint.async_save``: DCP writes a
directory of shards in its own format; unison's checkpoint is one ``weights_only`` file with a
header (`unison.training.checkpoint.pt`). The write releases the GIL while it copies bytes to the
file, so training goes on beside it. Sharded (``--shard full``) runs save synchronously through DCP
(`unison.training.checkpoint.dcp`), every rank its own shards.

Failures: an error of the background save (disk full, read-only or failing filesystem) is kept
and raised by `raise_if_failed()` (the loop polls it after every step, through the stop
agreement, so every rank ends), by the next save, `wait()` or `close()`. The run never trains
on without saving. `close(abort=True)` (Ctrl-C, a failure elsewhere) stops an unfinished save at
its next write and removes its temporary file: the previous checkpoint stays the latest.

Example::

    ckpt = Checkpointer(run_dir, keep=3, asynchronous=True)
    ckpt.save(state, step)          # returns once the snapshot is taken
    ...
    ckpt.raise_if_failed()          # after every step
    path = ckpt.wait()              # the file is complete
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .files import latest_checkpoint


class SaveAborted(BaseException):
    """Raised inside an unfinished background save that `close(abort=True)` stopped."""


def snapshot(obj: Any) -> Any:
    """A copy of `obj` whose tensors no longer share memory with the live ones (on the CPU)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.cpu() if t.device.type != "cpu" else t.clone()
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class Checkpointer:
    """Saves `state` dicts as checkpoints of `run_dir`, synchronously or one at a time in the background."""

    def __init__(self, run_dir: str | Path, keep: int, *, asynchronous: bool = True,
                 on_write: Callable[[int, int], None] | None = None) -> None:
        self.run_dir, self.keep, self.asynchronous = Path(run_dir), keep, asynchronous
        self.on_write = on_write          # (step, bytes written so far): testing hook (fault injection)
        self.wait_s: list[float] = []     # per save: how long the step loop was held up (the caller records it)
        self.last_path: Path | None = None
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        # Waiting uses this event, not Thread.join(): a KeyboardInterrupt in join() makes CPython 3.11 mark the
        # still-running writer as stopped (bpo-45274's handling), and a later join() would return at once while
        # the file is half-written.
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._abort = threading.Event()

    # ------------------------------------------------------------------ saving
    def save(self, state: dict, step: int) -> None:
        from .pt import save_checkpoint  # the file's format: imported by the first save, on the loop's thread

        self.wait()
        if self.asynchronous:
            copy = snapshot(state)
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._write, args=(save_checkpoint, copy, step, self._done),
                                            name="unison-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(save_checkpoint, state, step)
            self._raise_error()

    def _write(self, save_checkpoint: Callable[..., Path], state: dict, step: int,
               done: threading.Event | None = None) -> None:
        def on_write(written: int) -> None:
            if self._abort.is_set():
                raise SaveAborted(f"checkpoint of step {step} aborted")
            if self.on_write is not None:
                self.on_write(step, written)

        try:
            self.last_path = save_checkpoint(self.run_dir, state, step, keep=self.keep, on_write=on_write)
            self.last_step = step
        except SaveAborted:
            pass
        except BaseException as e:  # kept for the loop: a failed save must end the run
            self._error = e
        finally:
            if done is not None:
                done.set()

    # ------------------------------------------------------------------ waiting, failures
    @property
    def in_flight(self) -> bool:
        return self._thread is not None and not self._done.is_set()

    def failed(self) -> bool:
        """True when a save failed (without waiting for one in flight)."""
        return self._error is not None

    def raise_if_failed(self) -> None:
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self) -> Path | None:
        """Wait for the save in flight; raise its error; return the last checkpoint written."""
        if self._thread is not None:
            self._done.wait()
            self._thread = None
        self._raise_error()
        return self.last_path

    def latest(self) -> Path | None:
        """The last complete checkpoint of the run directory (this run's or an earlier one's)."""
        return self.last_path if self.last_path is not None and not self.in_flight else latest_checkpoint(self.run_dir)

    def close(self, *, abort: bool = False, timeout_s: float = 60.0) -> None:
        """Finish (or with `abort`, stop) the save in flight. Errors of an aborted save are dropped."""
        if abort:
            self._abort.set()
        if self._thread is not None:
            self._done.wait(timeout_s)
            self._thread = None
        if abort:
            self._error = None
