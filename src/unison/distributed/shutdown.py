"""Leaving the process group at the end of a worker: every rank waits for the others after a clean end, and what
holds the group is freed while the interpreter is whole (gloo's teardown at the interpreter's exit aborts now and
then). `shutdown_distributed` is the one way out; `unison.distributed.env` re-exports it."""

from __future__ import annotations

import gc
import time
import traceback

import torch.distributed as dist

from unison.errors import Preempted

__all__ = ["shutdown_distributed"]

_shutdowns = 0   # process groups this process has left: every rank leaves the same sequence, so keys match


def shutdown_distributed(error: BaseException | None, *, wait_s: float = 60.0) -> None:
    """Leave the process group. After a clean end (`error` None, or `Preempted`: every rank stopped after the same
    step), first wait until every rank has returned from its last collective (a counter in the rendezvous store).

    Why: a collective's last message may still be in flight to a slower peer when a rank returns from it;
    tearing gloo's connections down then resets that peer's read ("pair.cc: Read error") and can abort
    the leaving rank in gloo's teardown ("double free or corruption"). A rank that failed leaves at once:
    its peers may be stuck in a collective it will never join, and its error must reach the launcher now.
    The wait is bounded (`wait_s`)."""
    global _shutdowns
    if not (dist.is_available() and dist.is_initialized()):
        return
    _shutdowns += 1
    # a stop in the middle of a step (`unison.training.preemption.MidStepStop`) leaves at once: its peers may be
    # inside the step's collectives, which it will not join
    clean = error is None or (isinstance(error, Preempted) and not error.mid_step)
    if clean and dist.get_world_size() > 1:
        _wait_for_every_rank(f"unison/left/{_shutdowns}", dist.get_world_size(), wait_s)
    _release_process_group_holders(error)
    dist.destroy_process_group()


def _release_process_group_holders(error: BaseException | None) -> None:
    """Free what still holds the process group (DDP's reducer, FSDP's state: reference cycles, or locals kept by
    the error's traceback) now, while the interpreter is whole. `destroy_process_group` only unregisters the group;
    its last holder freed during the interpreter's exit runs gloo's teardown then, which can abort the process
    ("terminate called without an active exception", SIGABRT)."""
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()


def _wait_for_every_rank(key: str, world: int, wait_s: float) -> None:
    """Count this rank in under `key`, wait for all. Then rank 0, which hosts the store, waits until every rank
    has also counted itself out, so no rank's last store request meets a store already gone (the store client
    prints a 'Connection reset by peer' warning with a C++ stack then)."""
    deadline = time.monotonic() + wait_s

    def wait_for(counter: str) -> None:
        while store.add(counter, 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)

    try:
        store = dist.distributed_c10d._get_default_store()
        store.add(f"{key}/in", 1)
        wait_for(f"{key}/in")
        store.add(f"{key}/out", 1)
        if dist.get_rank() == 0:
            wait_for(f"{key}/out")
    except (RuntimeError, ValueError, OSError):   # the store is gone: nothing left to wait for
        pass
