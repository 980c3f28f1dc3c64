"""TESTING ONLY: fault injection into the training loop, behind one hook.

``UNISON_FAULT_INJECT="rank=1,step=3[,kind=KIND][,at=step|data|save][,to=self|launcher][,attempt=0]"``
makes rank 1 fail when it is about to run step 3; several faults are separated by ``;``. The
fault tests (tests/test_faults.py, tests/test_preemption.py, tests/test_watchdog.py) use it to
prove that killed, crashed, NaN, hung, stopped, preempted and interrupted workers end the run
cleanly. Never set it for real runs. Without the variable every hook does nothing.

KIND: ``kill`` (SIGKILL, the default), ``raise`` (a RuntimeError), ``nan`` (a NaN loss),
``hang`` (sleep forever), ``stop`` (SIGSTOP: frozen until SIGCONT), ``term``, ``usr1``, ``int``
(send SIGTERM, SIGUSR1 or SIGINT). ``to=launcher`` sends the signal to the parent process
(unison's launcher) instead of this worker.

AT: ``step`` (default; before step S, in the step phase), ``data`` (while the batch of step S is
being produced: a blocked data loader), ``save`` (in the middle of writing the checkpoint of
step S, after its first MiB: a kill or a second signal during a save).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from unison.distributed.env import restart_count
from unison.errors import ConfigError

FAULT_ENV = "UNISON_FAULT_INJECT"
FAULT_KINDS = ("kill", "raise", "nan", "hang", "stop", "term", "usr1", "int")
FAULT_PLACES = ("step", "data", "save")
_SIGNALS = {"kill": "SIGKILL", "stop": "SIGSTOP", "term": "SIGTERM", "usr1": "SIGUSR1", "int": "SIGINT"}
_SAVE_AFTER_BYTES = 1 << 20


def _parse_one(item: str) -> dict[str, Any]:
    fields = dict(part.strip().split("=", 1) for part in item.split(","))
    fault = {"rank": int(fields.pop("rank")), "step": int(fields.pop("step")), "kind": fields.pop("kind", "kill"),
             "at": fields.pop("at", "step"), "to": fields.pop("to", "self"), "attempt": int(fields.pop("attempt", "0"))}
    if (fields or fault["kind"] not in FAULT_KINDS or fault["at"] not in FAULT_PLACES
            or fault["to"] not in ("self", "launcher") or (fault["kind"] == "nan" and fault["at"] != "step")):
        raise ValueError
    return fault


def _faults_from_env() -> list[dict[str, Any]]:
    """TESTING ONLY: the faults that ``UNISON_FAULT_INJECT`` asks for in this restart attempt.

    A fault fires in restart attempt ``attempt`` only (default 0), so a worker restarted by
    torchrun does not fail again. Steps are 0-based: step 3 comes after 3 completed steps.
    """
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return []
    try:
        faults = [_parse_one(item) for item in spec.split(";") if item.strip()]
    except (ValueError, KeyError):
        raise ConfigError(f"{FAULT_ENV}={spec!r} must look like 'rank=1,step=3[,kind={'|'.join(FAULT_KINDS)}]"
                          f"[,at={'|'.join(FAULT_PLACES)}][,to=self|launcher][,attempt=0]' (';' between faults); "
                          "it is for testing only, unset it") from None
    return [f for f in faults if f["attempt"] == restart_count()]


def _fire(fault: dict[str, Any], rank: int, step: int) -> bool:
    """Fire one fault; True = poison this step's loss."""
    where = f" ({fault['at']})" if fault["at"] != "step" else ""
    target = " to the launcher" if fault["to"] == "launcher" else ""
    # os.write: this may run inside a checkpoint write; the time lets tests measure how fast the run ends
    os.write(2, f"unison: {FAULT_ENV}: {fault['kind']}{target} on rank {rank} at step {step}{where} "
                f"(t={time.time():.3f})\n".encode())
    sys.stderr.flush()
    if fault["kind"] in _SIGNALS:
        sig = getattr(signal, _SIGNALS[fault["kind"]], signal.SIGTERM)
        os.kill(os.getppid() if fault["to"] == "launcher" else os.getpid(), sig)
        if fault["kind"] in ("term", "usr1", "int"):
            # let the signal take effect here, inside the step or the save (a save waits longer: the signal may
            # travel through the launcher and back to this process)
            time.sleep(2.0 if fault["at"] == "save" else 0.2)
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV})")
    while fault["kind"] == "hang":
        time.sleep(3600)
    return fault["kind"] == "nan"


class FaultHook:
    """The test faults of ``UNISON_FAULT_INJECT`` for this worker, fired by the loop's hooks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.faults = _faults_from_env()

    def _due(self, at: str, step: int) -> list[dict[str, Any]]:
        return [f for f in self.faults if f["rank"] == self.rank and f["step"] == step and f["at"] == at]

    def before_step(self, step: int) -> bool:
        """Fire the faults due before `step`; True = poison this step's loss (kind=nan)."""
        poison = False
        for fault in self._due("step", step):
            poison |= _fire(fault, self.rank, step)
        return poison

    def batches(self, micro_batches: Iterator[Any]) -> Iterator[Any]:
        """Pass `micro_batches` through; a fault ``at=data`` fires while the batch of its step is awaited."""
        if not any(f["at"] == "data" for f in self.faults):
            yield from micro_batches
            return
        for batch in micro_batches:
            if batch.micro == 0:
                for fault in self._due("data", batch.step):
                    _fire(fault, self.rank, batch.step)
            yield batch

    def during_save(self, step: int, written: int) -> None:
        """Called while the checkpoint of `step` is written (`Checkpointer.on_write`); fires ``at=save`` faults."""
        if written < _SAVE_AFTER_BYTES:
            return
        for fault in self._due("save", step):
            self.faults.remove(fault)   # once, not on every following write
            _fire(fault, self.rank, step)
