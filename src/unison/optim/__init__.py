"""Optimizers by name, for the training step: sgd (with momentum), lars, adam, adamw.

`build_optimizer(name, params, lr, weight_decay)` returns a plain ``torch.optim.Optimizer``;
every one of them works on plain and on FSDP2-sharded (DTensor) parameters (torch's own
optimizers natively; `LARS` computes its trust ratio from full-parameter norms). `unison.optim.groups`:
per-block learning-rate factors (``--layer-decay``) as parameter groups, and the parameters ``--freeze`` names.

Example::

    opt = build_optimizer("lars", model.parameters(), lr=0.3, weight_decay=1e-6)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["LARS", "OPTIMIZER_NAMES", "build_optimizer", "constructor_args", "state_per_parameter"]

OPTIMIZER_NAMES = ("sgd", "lars", "adam", "adamw")


def constructor_args(optimizer: Optimizer) -> dict[str, Any]:
    """The hyper-parameters to build another optimizer of the same class: ``optimizer.defaults`` minus
    what its ``__init__`` does not take (torch 2.14's AdamW records ``decoupled_weight_decay``)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def build_optimizer(name: str, params: Iterable[Any], lr: float, weight_decay: float, momentum: float = 0.9,
                    betas: tuple[float, float] = (0.9, 0.999)) -> Optimizer:
    """A plain optimizer by name: sgd (with momentum), lars, adam, adamw."""
    key = name.lower() if isinstance(name, str) else name
    if key == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "lars":
        from .lars import LARS

        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; known optimizers are {', '.join(OPTIMIZER_NAMES)}")


def state_per_parameter(name: str, momentum: float = 0.9) -> tuple[int, int]:
    """(tensors the size of the parameter, scalar tensors) that `build_optimizer(name, ...)` keeps for each
    trainable parameter once it has stepped: SGD and LARS a momentum buffer unless `momentum` is 0; Adam and AdamW
    both moments and a step counter. The one rule the memory estimate (`unison.training.memory`) counts by."""
    key = name.lower()
    if key in ("sgd", "lars"):
        return (1 if momentum != 0 else 0), 0
    if key in ("adam", "adamw"):
        return 2, 1
    raise ValueError(f"unknown optimizer {name!r}; known optimizers are {', '.join(OPTIMIZER_NAMES)}")


def __getattr__(name: str) -> Any:
    """`LARS`, imported on first use: the runs of the other optimizers never read it."""
    if name == "LARS":
        from .lars import LARS

        return LARS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
