"""Hooks: what runs around the training step, and the one way to add more (tests inject faults with it).

The trainer (`unison.training.trainer`) calls every hook of a run, on every rank, at these points:

    hook.start(run, step)           once, before the first batch is asked for (`step`: steps already done)
    hook.on_batch(run, batch)       as each micro-batch arrives, still in the watchdog's "data" phase
    hook.before_step(run, step)     before optimiser step `step` (0-based) computes, its micro-batches loaded
    hook.after_step(run, end)       after the optimiser step; ``end.step`` steps are complete (`StepEnd`)
    hook.on_checkpoint_write(step, written)   while rank 0 writes the checkpoint of `step` (maybe in the
                                    background writer thread), after every write; `written`: bytes so far
    hook.close()                    after the last step (not after a failure), in reverse order

A hook subclasses `TrainHook` and overrides what it needs; the others do nothing. Hooks run after the
trainer's own work of each step (logging, evaluation, checkpoints, the stop agreement), in the order given. A hook
may set ``end.stop`` to end the run after the step, through its normal end (every rank must set it at the same
step).

Extra hooks come from ``train(cfg, device, hooks=[...])`` (in-process runs), or, for workers that
are separate processes (unison's launcher, torchrun, srun, mpirun), from the environment:
``UNISON_TRAIN_HOOKS=module[,module...]`` names importable modules; each worker imports them and
calls their ``train_hooks(cfg, rank) -> list[TrainHook]``. The fault-injection tests register
``tests/fault_injection.py`` this way; production runs leave the variable unset.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from unison.config import TrainConfig
from unison.errors import ConfigError
from unison.training.step import Batch, Run

HOOKS_ENV = "UNISON_TRAIN_HOOKS"


@dataclass
class StepEnd:
    """What the hooks see after an optimiser step."""

    step: int                 # optimiser steps completed (the one just taken is ``step - 1``)
    lr: float                 # its learning rate
    loss: torch.Tensor        # this rank's loss of the step (not reduced): `accumulated_forward_backward`'s
    epoch_done: bool          # the step completed an epoch
    last: bool                # the run's last step (the end of the run saves and evaluates anyway)
    saved: bool = False       # a hook wrote this step's checkpoint (`CheckpointHook`; the stop agreement reads it)
    stop: bool = False        # a hook ends the run after this step, through the normal end (every rank must agree:
                              # the trainer's label-free signals decide from values every rank shares)

    @classmethod
    def of(cls, run: Run, step: int, lr: float, loss: torch.Tensor) -> StepEnd:
        return cls(step, lr, loss, epoch_done=step % run.steps_per_epoch == 0, last=step == run.total_steps)


class TrainHook:
    """A hook of the training loop; every method does nothing unless overridden (see the module docstring)."""

    def start(self, run: Run, step: int) -> None:
        """Before the first batch is asked for; `step` optimiser steps are already done (a resumed run)."""

    def on_batch(self, run: Run, batch: Batch) -> None:
        """As each micro-batch arrives (watchdog phase "data": a hook that blocks here looks like a stuck loader)."""

    def before_step(self, run: Run, step: int) -> None:
        """Before optimiser step `step` (0-based) computes: its micro-batches are loaded."""

    def after_step(self, run: Run, end: StepEnd) -> None:
        """After the optimiser step: ``end.step`` steps are complete."""

    def on_checkpoint_write(self, step: int, written: int) -> None:
        """While the checkpoint of `step` is written, after every write (`written`: bytes so far)."""

    def close(self) -> None:
        """After the last step (not after a failure)."""


def hooks_from_env(cfg: TrainConfig, rank: int) -> list[TrainHook]:
    """The hooks of the modules ``UNISON_TRAIN_HOOKS`` names (none when it is unset); `ConfigError` if one is bad."""
    names = [name.strip() for name in os.environ.get(HOOKS_ENV, "").split(",") if name.strip()]
    hooks: list[TrainHook] = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{HOOKS_ENV} names {name!r}, which cannot be imported ({exc}); put it on PYTHONPATH "
                              f"or unset {HOOKS_ENV}") from None
        factory = getattr(module, "train_hooks", None)
        if not callable(factory):
            raise ConfigError(f"{HOOKS_ENV} names {name!r}, which has no train_hooks(cfg, rank) function")
        hooks.extend(factory(cfg, rank))
    return hooks

