"""Why each host synchronisation of the training step is there: the table `unison plan` prints beside them.

A host synchronisation (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask indexing) makes the CPU wait for the
GPU, draining the queue of launched kernels. `unison.plan.fake.HostSyncRecorder` finds every one the step makes;
each must match an entry here, which says why it stays. One that matches none is a defect: `unison plan` prints it
as unexplained and the suite's method x shard x amp matrix (tests/unit/plan/test_plan.py) fails on it.

An entry matches by where the step's code is (a file and a function, the first frame outside torch) and, when torch
itself reads the value, by torch's frame below it. Entries that name only torch's frame match wherever the step
calls into it (an optimizer's step counter is read the same way under DDP and under ZeRO-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fake import HostSync

__all__ = ["KNOWN_SYNCS", "KnownSync", "explain", "explained_lines", "unexplained"]


@dataclass(frozen=True)
class KnownSync:
    where: str     # "file (function)" of the step's code, "" for any
    inside: str    # a part of torch's frame below it, "" for none (the step's own code reads the value)
    reason: str

    def matches(self, sync: HostSync) -> bool:
        if self.where:
            path, _, function = self.where.partition(" ")
            if not (sync.where.startswith(path) and sync.where.endswith(function)):
                return False
        return self.inside in sync.inside if self.inside else not sync.inside


KNOWN_SYNCS: tuple[KnownSync, ...] = (
    KnownSync("src/unison/training/step.py (_loss)", "",
              "the finite-loss check: a NaN step must fail before its backward, leaving the last checkpoint good"),
    KnownSync("", "torch/optim/optimizer.py",
              "torch's optimizer reads its step counter, a CPU tensor on GPUs too: a host read, no device sync"),
    KnownSync("src/unison/training/step.py (optimizer_step)", "grad_scaler.py",
              "fp16's GradScaler reads found_inf before stepping (torch's design: one device sync per step)"),
    KnownSync("", "torch/nn/modules/_functions.py",
              "torch.nn.SyncBatchNorm drops empty ranks with a boolean mask (torch's design, per BN layer)"),
    KnownSync("src/unison/methods/dino.py (forward)", "", "the teacher temperature is scheduled by the step counter"),
    KnownSync("src/unison/methods/ibot.py (forward)", "", "the teacher temperature is scheduled by the step counter"),
    KnownSync("src/unison/methods/lejepa.py (forward)", "", "the step's random directions are seeded by its counter"),
    KnownSync("src/unison/methods/swav.py (forward)", "", "the prototypes are frozen for the first steps (step counter)"),
    KnownSync("src/unison/methods/moco.py (_enqueue)", "", "the queue pointer (where this step's keys go)"),
    KnownSync("src/unison/methods/nnclr.py (_enqueue)", "", "the support set's pointer (where this step's projections go)"),
)


def explain(sync: HostSync) -> str | None:
    """Why `sync` is there, or None when no entry explains it (a defect)."""
    return next((known.reason for known in KNOWN_SYNCS if known.matches(sync)), None)


def unexplained(syncs: list[HostSync]) -> list[HostSync]:
    return [s for s in syncs if explain(s) is None]


def explained_lines(syncs: list[HostSync]) -> list[str]:
    """One line per distinct host sync (counted), each followed by why it is there (`KNOWN_SYNCS`)."""
    counts: dict[str, list[HostSync]] = {}
    for h in syncs:
        counts.setdefault(str(h), []).append(h)
    lines = []
    for text, same in counts.items():
        lines.append(f"  {len(same)} x {text}" if len(same) > 1 else f"  {text}")
        lines.append(f"      why: {explain(same[0]) or 'NOT EXPLAINED: a defect, please report it'}")
    return lines
