"""TESTING ONLY: fault injection into the training loop, behind one hook.

``UNISON_FAULT_INJECT="rank=1,step=3[,kind=kill|raise|nan|hang][,attempt=0]"`` makes rank 1
fail when it is about to run step 3; the fault tests (tests/test_faults.py) use it to
prove that a killed, crashed, NaN or hung worker ends the run cleanly. Never set it for
real runs. The loop calls `FaultHook.before_step` once per step; without the variable it
does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from unison.distributed.env import restart_count
from unison.errors import ConfigError

FAULT_ENV = "UNISON_FAULT_INJECT"
FAULT_KINDS = ("kill", "raise", "nan", "hang")


def _fault_from_env() -> dict[str, Any] | None:
    """TESTING ONLY: the fault that ``UNISON_FAULT_INJECT`` asks for, or None.

    ``UNISON_FAULT_INJECT="rank=1,step=3[,kind=kill|raise|nan|hang][,attempt=0]"`` makes rank 1 fail
    when it is about to run step 3 (0-based, i.e. after 3 completed steps) in restart attempt 0 only,
    so a worker restarted by torchrun does not fail again. kill: SIGKILL itself; raise: a
    RuntimeError; nan: a NaN loss; hang: sleep forever (its peers time out after --timeout-s).
    The fault tests (tests/test_faults.py) use it; never set it for real runs.
    """
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    try:
        fields = dict(item.strip().split("=", 1) for item in spec.split(","))
        fault = {"rank": int(fields.pop("rank")), "step": int(fields.pop("step")),
                 "kind": fields.pop("kind", "kill"), "attempt": int(fields.pop("attempt", "0"))}
        if fields or fault["kind"] not in FAULT_KINDS:
            raise ValueError
    except (ValueError, KeyError):
        raise ConfigError(f"{FAULT_ENV}={spec!r} must look like 'rank=1,step=3[,kind=kill|raise|nan|hang]"
                          f"[,attempt=0]'; it is for testing only, unset it") from None
    return fault if fault["attempt"] == restart_count() else None


def _inject_fault(fault: dict[str, Any] | None, rank: int, step: int) -> bool:
    """Fire the test fault if it is due on this rank at this step; True = poison this step's loss."""
    if fault is None or fault["rank"] != rank or fault["step"] != step:
        return False
    print(f"unison: {FAULT_ENV}: {fault['kind']} on rank {rank} at step {step} (t={time.time():.3f})",
          file=sys.stderr, flush=True)  # the time lets tests measure how fast the run ends
    if fault["kind"] == "kill":
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV})")
    while fault["kind"] == "hang":
        time.sleep(3600)
    return fault["kind"] == "nan"


class FaultHook:
    """The test fault of ``UNISON_FAULT_INJECT`` for this worker, fired by `before_step`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fault = _fault_from_env()

    def before_step(self, step: int) -> bool:
        """Fire the fault if it is due at `step`; True = poison this step's loss (kind=nan)."""
        return _inject_fault(self.fault, self.rank, step)
