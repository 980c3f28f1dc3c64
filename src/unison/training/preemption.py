"""Preemption: finish the step, agree, checkpoint, exit with `PREEMPTED_EXIT_CODE` (75).

A stop request (SIGTERM or SIGUSR1, recorded by `unison.distributed.signals`) may reach one
rank, some, or all (SLURM and torchrun signal every worker, ``kill`` one process, unison's
launcher forwards what it receives). After every optimiser step the ranks agree, with one
all-reduce (MAX) of four integers, on whether to stop:

* a stop signal arrived on some rank (its number and the rank are agreed too), or
* rank 0's background checkpoint save failed (disk full, read-only, I/O error): the run ends
  with that error rather than training on without saving;
* or, in a ``--time-budget`` run, rank 0's clock says the time is up: not a stop but the run's normal end
  (final kNN, checkpoint, summary) one step later on every rank (`unison.training.budget`).

All ranks therefore stop after the same step (the exchange runs in the background, so the step
after the one in which the signal arrived: `StopAgreement`). On a stop request every rank takes
part in the checkpoint of that step (unless it was just written), rank 0 waits until the file is complete,
and every rank raises `Preempted`, whose message names the checkpoint and how to continue:
``--resume auto`` with the same ``--out`` (what a SLURM ``--requeue`` or a torchrun restart of
the same command does by itself, see `unison.distributed.env.restart_reason`).

Cost: one asynchronous all-reduce of 4 int64 per step on a CPU group (docs/reliability.md).

A step of many micro-batches (``--grad-sync-every K``) can take minutes or hours: a stop request does not wait for
it (`MidStepStop`). Between two of its micro-batches, while they are gathered or computed one by one, the rank
stops at once, without a checkpoint of the unfinished step: the last checkpoint stands. Under unison's launcher,
torchrun or SLURM every rank receives the signal; a rank that did not fails at its next collective, and the run
ends as preempted all the same.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unison.config.fields import count
from unison.distributed import collectives as C
from unison.distributed.elastic import nodes_waiting
from unison.distributed.signals import StopRequests, stop_requests
from unison.errors import CheckpointError, Preempted
from unison.training.checkpoint import latest_checkpoint


@dataclass(frozen=True)
class StopDecision:
    """What the ranks agreed after a step."""

    signal_number: int = 0      # the stop signal (0: none)
    signal_rank: int = -1       # a rank that received it
    save_failed: bool = False   # rank 0's background save failed
    out_of_time: bool = False   # rank 0's clock says a --time-budget run must end now (a normal end, not a stop)

    @property
    def stop(self) -> bool:
        return self.signal_number != 0 or self.save_failed

    def signal_name(self) -> str:
        return signal.Signals(self.signal_number).name if self.signal_number else ""


class StopAgreement:
    """The per-step agreement, exchanged in the background: the decision read after step N was started after N-1.

    One all-reduce (MAX) of 4 int64 per step, issued asynchronously on a CPU (gloo) group, so the step loop
    neither waits for it nor synchronises with the GPU: with NCCL the default group would need a CUDA tensor
    and a host-device sync every step. The price is one step of delay: a signal received during step N is
    acted on after step N+1, on every rank alike.
    """

    def __init__(self) -> None:
        self._group: Any = None   # None: the default group (gloo already)
        if C.is_distributed() and C.world_size() > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")   # collective: every rank builds it at the same point
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, requests: StopRequests, save_failed: bool, out_of_time: bool = False) -> StopDecision:
        """Every rank calls this after every step: the decision of the previous exchange; starts the next one.
        `out_of_time`: rank 0's budget clock (`unison.training.budget`); the other ranks pass False."""
        decision = self._finish()
        mine = torch.tensor([int(requests.first or 0), C.rank() if requests.requested else -1, int(save_failed),
                             int(out_of_time)], dtype=torch.int64)
        if C.is_distributed() and C.world_size() > 1:
            self._pending = (dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True), mine)
        else:
            self._pending = (None, mine)
        return decision

    def _finish(self) -> StopDecision:
        if self._pending is None:
            return StopDecision()
        work, agreed = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        a, b, c, d = agreed.tolist()
        return StopDecision(int(a), int(b), bool(c), bool(d))

    def close(self) -> None:
        """Wait for the exchange in flight (before the process group goes away)."""
        self._finish()


def save_failed_elsewhere() -> CheckpointError:
    """What ranks other than 0 raise when rank 0's checkpoint save failed (rank 0 raises the error itself)."""
    return CheckpointError("rank 0 could not write a checkpoint (its error says why); the run stops rather than "
                           "train on without saving")


def preempted(decision: StopDecision, step: int, total_steps: int, checkpoint: str | None) -> Preempted:
    """What every rank raises after the preemption checkpoint is complete (collective: rank 0 asks torchrun's
    rendezvous whether nodes wait to join, `unison.distributed.elastic.nodes_waiting`, and tells the others). A
    SIGTERM while nodes wait is torchrun re-forming the group with them: said as such, not as an error."""
    where = (f"checkpoint {checkpoint} written" if checkpoint else "the checkpoint was written by rank 0")
    joining = nodes_waiting() if decision.signal_name() == "SIGTERM" and C.rank() == 0 else None
    joining = C.broadcast_object(joining) if C.is_distributed() and C.world_size() > 1 else joining
    if joining:
        return Preempted(f"stopped by SIGTERM after step {step} of {total_steps} for {count(joining, 'node')} "
                         f"joining: torchrun re-forms the group with more workers, which resume from there ({where})",
                         signal_name="SIGTERM", regroup=True)
    return Preempted(f"preempted by {decision.signal_name()} (received by rank {decision.signal_rank}) after step "
                     f"{step} of {total_steps}: {where}; continue with --resume auto and the same --out",
                     signal_name=decision.signal_name())


class MidStepStop:
    """Ends a step of several micro-batches between two of them when a stop signal has arrived (see the module
    docstring): `gather` passes the micro-batches through as they are made; called with a micro-batch, before
    its forward (`unison.training.step.accumulated_forward_backward`)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.requests = stop_requests()

    def gather(self, micro_batches: Iterator[Any]) -> Iterator[Any]:
        for batch in micro_batches:
            self(batch)
            yield batch

    def __call__(self, batch: Any) -> None:
        if batch.micro > 0 and self.requests.requested:
            raise self.stopped(batch)

    def stopped(self, batch: Any) -> Preempted:
        k = self.run.accumulate
        last = latest_checkpoint(Path(self.run.cfg.out))
        kept = (f"the last checkpoint, {last}, stands; continue with --resume auto and the same --out" if last else
                "no checkpoint was written yet: run the same command again")
        stop = Preempted(f"stopped by {self.requests.name()} during step {batch.step} (micro-batch {batch.micro} of "
                         f"{k}, --grad-sync-every {k}), without finishing it: {kept}", signal_name=self.requests.name())
        stop.mid_step = True   # (`unison.distributed.shutdown`: no waiting for the peers on the way out)
        return stop
