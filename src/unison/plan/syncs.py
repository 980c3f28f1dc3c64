"""Why each host synchronisation of the training step is there: the table `unison plan` prints beside them.

A host synchronisation (``.item()``, ``bool(t)``, ``nonzero``, boolean-mask indexing) makes the CPU wait for the
GPU, draining the queue of launched kernels. `unison.plan.fake.HostSyncRecorder` finds every one the step makes;
each must match an entry here, which says why it stays. One that matches none is a defect: `unison plan` prints it
as unexplained and the suite's method x shard x amp matrix (tests/plan/test_plan.py) fails on it.

An entry matches by where the step's code is (a file and a function, the first frame outside torch) and, when torch
itself reads the value, by torch's frame below it. Entries that name only torch's frame match wherever the step
calls into it (an optimizer's step counter is read the same way under DDP and under ZeRO-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fake import HostSync

__all__ = ["KNOWN_SYNCS", "KnownSync", "explain", "explained_lines", "known", "unexplained"]


@dataclass(frozen=True)
class KnownSync:
    where: str     # "file (function)" of the step's code, "" for any
    inside: str    # a part of torch's frame below it, "" for none (the step's own code reads the value)
    name: str      # what makes it, as a user knows it (a torch class, a method's schedule): the report's words
    reason: str

    def matches(self, sync: HostSync) -> bool:
        if self.where:
            path, _, function = self.where.partition(" ")
            if not (sync.where.startswith(path) and sync.where.endswith(function)):
                return False
        return self.inside in sync.inside if self.inside else not sync.inside


KNOWN_SYNCS: tuple[KnownSync, ...] = (
    KnownSync("src/unison/training/step.py (_loss)", "", "unison's finite-loss check",
              "a NaN step must fail before its backward, leaving the last checkpoint good"),
    KnownSync("", "torch/optim/optimizer.py", "torch.optim's step counter",
              "a CPU tensor on GPUs too: a host read, no device sync"),
    KnownSync("src/unison/training/step.py (optimizer_step)", "grad_scaler.py", "torch.amp.GradScaler (fp16)",
              "reads found_inf before stepping (torch's design: one device sync per step)"),
    KnownSync("", "torch/nn/modules/_functions.py", "torch.nn.SyncBatchNorm",
              "drops empty ranks with a boolean mask (torch's design, per BN layer)"),
    KnownSync("src/unison/methods/dino.py (forward)", "", "DINO's teacher temperature",
              "scheduled by the step counter"),
    KnownSync("src/unison/methods/ibot.py (forward)", "", "iBOT's (and DINOv2's) teacher temperature",
              "scheduled by the step counter"),
    KnownSync("src/unison/methods/dinov3.py (forward)", "", "DINOv3's teacher temperature and Gram anchoring",
              "scheduled by the step counter (and the count of Gram teacher loads)"),
    KnownSync("src/unison/methods/lejepa.py (forward)", "", "LeJEPA's random directions",
              "seeded by the step counter"),
    KnownSync("src/unison/methods/swav.py (forward)", "", "SwAV's prototypes",
              "frozen for the first steps (step counter)"),
    KnownSync("src/unison/methods/moco.py (_enqueue)", "", "MoCo's queue pointer", "where this step's keys go"),
    KnownSync("src/unison/methods/nnclr.py (_enqueue)", "", "NNCLR's support set pointer",
              "where this step's projections go"),
    KnownSync("src/unison/methods/smog.py (forward)", "", "SMoG's view roles",
              "the two views swap roles every other step (step counter)"),
    KnownSync("src/unison/methods/densecl.py (_enqueue)", "", "DenseCL's queue pointer", "where this step's keys go"),
    KnownSync("src/unison/methods/densecl.py (_loss_lambda)", "", "DenseCL's dense-term warm-up",
              "lambda 0 for the first --param lambda_warmup_steps steps (step counter)"),
)


def known(sync: HostSync) -> KnownSync | None:
    """The entry that explains `sync`, or None (a defect)."""
    return next((k for k in KNOWN_SYNCS if k.matches(sync)), None)


def explain(sync: HostSync) -> str | None:
    """Why `sync` is there, or None when no entry explains it (a defect)."""
    entry = known(sync)
    return f"{entry.name}: {entry.reason}" if entry else None


def unexplained(syncs: list[HostSync]) -> list[HostSync]:
    return [s for s in syncs if explain(s) is None]


def explained_lines(syncs: list[HostSync]) -> list[str]:
    """One line per cause, counted, in the words a user knows (``162 x torch.nn.SyncBatchNorm: ...``), not torch's
    file and line; one that no entry explains names the step's own code where it happens, and torch's module."""
    counts: dict[str, int] = {}
    for h in syncs:
        entry = known(h)
        if entry is not None:
            text = f"{entry.name}: {entry.reason}"
        else:
            inside = f", inside {_module(h.inside)}" if h.inside else ""
            text = f"NOT EXPLAINED, a defect, please report it: {h.op} at {h.where}{inside}"
        counts[text] = counts.get(text, 0) + 1
    return [f"  {n:,} x {text}" for text, n in counts.items()]


def _module(frame: str) -> str:
    """``torch/nn/modules/_functions.py:98 (forward)`` as the module a user can look up: torch.nn.modules._functions."""
    path = frame.split(":", 1)[0]
    return path.removesuffix(".py").replace("/", ".")
