"""Leaving the process group: after a clean end a rank waits for its peers' last collective; after a failure not.

What is timed is the wait for the peers alone, up to the moment leaving starts to free the group: the freeing
(`gc.collect`, gloo's teardown) took 0.05 s on a quiet machine and 0.64 s on a loaded 2-core CI, and is not what
these tests are about."""

from __future__ import annotations

import time

from unison.distributed import collectives as C
from unison.distributed import shutdown
from unison.distributed.testing import run_in_workers

LINGER_S = 1.0


def _waited_for_peers(slow_rank: int, failed: bool) -> float:
    """Rank `slow_rank` lingers `LINGER_S` after the last collective; the others leave at once. How long each
    waited before freeing the group."""
    release = shutdown._release_process_group_holders
    freeing_started: list[float] = []

    def timed_release(error: BaseException | None) -> None:
        freeing_started.append(time.monotonic())
        release(error)

    shutdown._release_process_group_holders = timed_release
    C.barrier()
    if C.rank() == slow_rank:
        time.sleep(LINGER_S)
    started = time.monotonic()
    shutdown.shutdown_distributed(ValueError("this rank failed") if failed else None)
    return freeing_started[0] - started


def test_a_clean_rank_waits_for_the_slowest_before_tearing_down() -> None:
    fast, slow = run_in_workers(_waited_for_peers, 2, args=(1, False))
    assert fast > 0.8 * LINGER_S, f"rank 0 tore the group down {fast:.2f} s after its last collective, before " \
                                  f"rank 1 left it"
    assert slow < 0.5 * LINGER_S, f"the last rank to leave, which found every peer counted in, waited {slow:.2f} s"


def test_a_failed_rank_leaves_at_once() -> None:
    fast, _ = run_in_workers(_waited_for_peers, 2, args=(1, True))
    assert fast < 0.5 * LINGER_S, f"a failed rank waited {fast:.2f} s for its peers: its error would reach the " \
                                  f"launcher late"
