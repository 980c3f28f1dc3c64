"""TESTING ONLY: fault injection into the training loop, as a hook the tests register (not part of unison).

Registration: `register(monkeypatch)` sets ``UNISON_TRAIN_HOOKS=fault_injection`` (every worker then imports
this module and adds `train_hooks`'s hook after the loop's own: `unison.training.hooks`) and puts this folder on
``PYTHONPATH`` for workers started as fresh interpreters (torchrun, ``python -c``); the launcher's spawned
workers inherit ``sys.path`` anyway. Without ``UNISON_FAULT_INJECT`` the hook does nothing.

``UNISON_FAULT_INJECT="rank=1,step=3[,kind=KIND][,at=step|data|save][,to=self|launcher][,attempt=0]"``
makes rank 1 fail when it is about to run step 3; several faults are separated by ``;``. The
fault tests (test_faults, test_preemption, test_watchdog, test_disk_faults and test_resume in
tests/training/) use it to prove that killed, crashed, NaN, hung, stopped, preempted and
interrupted workers end the run cleanly.

KIND: ``kill`` (SIGKILL, the default), ``raise`` (a RuntimeError), ``nan`` (a NaN loss: the step's
``run.forward`` returns its loss times NaN), ``hang`` (sleep forever), ``stop`` (SIGSTOP: frozen until SIGCONT),
``term``, ``usr1``, ``int`` (send SIGTERM, SIGUSR1 or SIGINT), ``wait`` (block until this process receives a stop
signal, SIGTERM or SIGUSR1, at most 120 s, then run the step: a run that a test signals from outside at a known
step, e.g. with ``scancel --signal=USR1``, instead of sleeping and hoping). ``to=launcher`` sends the signal to the parent process
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
from pathlib import Path
from typing import Any

import torch

from unison.config import TrainConfig
from unison.distributed.env import restart_count
from unison.distributed.signals import stop_requests
from unison.errors import ConfigError
from unison.training.hooks import HOOKS_ENV, StepEnd, TrainHook
from unison.training.step import Batch, Run

FAULT_ENV = "UNISON_FAULT_INJECT"
FAULT_KINDS = ("kill", "raise", "nan", "hang", "stop", "term", "usr1", "int", "wait")
WAIT_MAX_S = 120.0
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
    torchrun, or a job requeued by SLURM, does not fail again. Steps are 0-based: step 3 comes after 3 completed steps.
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
    return [f for f in faults if f["attempt"] == _attempt()]


def _attempt() -> int:
    """torchrun's restart count, else SLURM's requeue count (``SLURM_RESTART_COUNT``), else 0."""
    requeued = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    return restart_count() or (int(requeued) if requeued.isdigit() else 0)


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
        # The launcher: unison's (its workers are the fork server's children) or torchrun's agent (the parent).
        launcher = int(os.environ.get("UNISON_LAUNCHER_PID", os.getppid()))
        os.kill(launcher if fault["to"] == "launcher" else os.getpid(), sig)
        if fault["kind"] in ("term", "usr1", "int"):
            # let the signal take effect here, inside the step or the save (a save waits longer: the signal may
            # travel through the launcher and back to this process)
            time.sleep(2.0 if fault["at"] == "save" else 0.2)
    if fault["kind"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV})")
    while fault["kind"] == "hang":
        time.sleep(3600)
    deadline = time.monotonic() + WAIT_MAX_S
    while fault["kind"] == "wait" and not stop_requests().requested and time.monotonic() < deadline:
        time.sleep(0.05)
    return fault["kind"] == "nan"


class NaNLoss(torch.nn.Module):
    """`run.forward` for one step: the wrapped module's loss times NaN (what kind=nan injects)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(*args, **kwargs) * float("nan")


class FaultHook(TrainHook):
    """The test faults of ``UNISON_FAULT_INJECT`` for this worker, as a hook of the training loop."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.faults = _faults_from_env()

    def _due(self, at: str, step: int) -> list[dict[str, Any]]:
        return [f for f in self.faults if f["rank"] == self.rank and f["step"] == step and f["at"] == at]

    def on_batch(self, run: Run, batch: Batch) -> None:
        """A fault ``at=data`` fires while the batch of its step is awaited (the watchdog's "data" phase)."""
        if batch.micro == 0:
            for fault in self._due("data", batch.step):
                _fire(fault, self.rank, batch.step)

    def before_step(self, run: Run, step: int) -> None:
        """Fire the faults due before `step`; kind=nan makes this step's losses NaN."""
        poison = False
        for fault in self._due("step", step):
            poison |= _fire(fault, self.rank, step)
        if poison:
            run.forward = NaNLoss(run.forward)

    def after_step(self, run: Run, end: StepEnd) -> None:
        if isinstance(run.forward, NaNLoss):   # (never reached: a NaN loss ends the run)
            run.forward = run.forward.inner

    def on_checkpoint_write(self, step: int, written: int) -> None:
        """Fires ``at=save`` faults while the checkpoint of `step` is written."""
        if written < _SAVE_AFTER_BYTES:
            return
        for fault in self._due("save", step):
            self.faults.remove(fault)   # once, not on every following write
            _fire(fault, self.rank, step)


def train_hooks(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    """What ``UNISON_TRAIN_HOOKS=fault_injection`` adds to every worker's loop."""
    return [FaultHook(rank)]


def register(monkeypatch: Any) -> None:
    """Register this module's hook for the runs of a test (workers in this process, spawned, or started afresh)."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv(HOOKS_ENV, __name__)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here if not path else os.pathsep.join([here, path]))
