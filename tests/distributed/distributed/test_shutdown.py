"""Leaving the process group: after a clean end a rank waits for its peers' last collective; after a failure not."""

from __future__ import annotations

import time

from unison.distributed import collectives as C
from unison.distributed.shutdown import shutdown_distributed
from unison.distributed.testing import run_in_workers


def _leave(slow_rank: int, failed: bool) -> float:
    """Rank `slow_rank` lingers 1 s after the last collective; the others leave at once. How long leaving took."""
    C.barrier()
    if C.rank() == slow_rank:
        time.sleep(1.0)
    started = time.monotonic()
    shutdown_distributed(ValueError("this rank failed") if failed else None)
    return time.monotonic() - started


def test_a_clean_rank_waits_for_the_slowest_before_tearing_down() -> None:
    fast, slow = run_in_workers(_leave, 2, args=(1, False))
    assert fast > 0.8, f"rank 0 tore the group down {fast:.2f} s after its last collective, before rank 1 left it"
    assert slow < 0.5


def test_a_failed_rank_leaves_at_once() -> None:
    fast, _ = run_in_workers(_leave, 2, args=(1, True))
    assert fast < 0.5, f"a failed rank waited {fast:.2f} s for its peers: its error would reach the launcher late"
