"""Validation of method hyper-parameters, in one place: each `Params` dataclass states its ranges.

Every method's ``Params`` calls `check_params` from ``__post_init__``, so a bad value is a
one-line `ConfigError` (exit code 2) when the configuration is validated, before any worker
starts, instead of a tensor-shape traceback (``proj_dim=-5``) or a zero-width head
(``proj_dim=0``) later::

    @dataclass
    class SimCLRParams:
        temperature: float = 0.5
        proj_dim: int = 128

        def __post_init__(self) -> None:
            check_params(self, sizes=("proj_dim",), positive=("temperature",))

Ranges: ``sizes`` integers in [1, 2**20] (dimensions, counts); ``classes`` integers in [2, 2**20] (the width of
a softmax: over one entry it is constant and the loss is 0); ``counts`` integers >= 0; ``positive`` finite numbers
> 0 (scales); ``temperatures`` finite numbers >= `MIN_TEMPERATURE`; ``sinkhorn`` (Sinkhorn epsilons, exponentiated
directly) finite numbers >= `MIN_SINKHORN_EPSILON`; ``non_negative`` loss weights in [0, `MAX_LOSS_WEIGHT`];
``unit_interval`` numbers in [0, 1] (momenta, probabilities, fractions). `check_trains` refuses loss weights that
are all 0 (a loss identically 0 trains nothing, like ``--lr 0``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from unison.config.fields import shown
from unison.errors import ConfigError

# A size (a width, a depth, a count of prototypes or queue entries) past 2**20 is no recipe's: refused before any
# worker builds a model of it (a 16M-wide head is 32 G parameters, found only as an out-of-memory kill).
MAX_SIZE = 2**20
# A softmax temperature t scales unit-norm similarities to logits up to 1/t; the loss and its gradient grow as 1/t
# and an optimizer's squared gradient as 1/t**2. At t >= 1e-4 the logits stay finite in float16 (65504) and the
# squares in float32 (3.4e38); at t = 1e-20, 1/t**2 is past float32 and SimCLR's loss is NaN at step 1.
MIN_TEMPERATURE = 1e-4
# Sinkhorn-Knopp exponentiates scores <= 1 as exp(score / epsilon) in float32 and sums up to 2**40 of them:
# exp(1 / 0.02) * 2**40 = 5.7e33 stays finite, while with epsilon = 0.01 a score of 1 (a prototype the embedding
# has learned) is e**100 = inf and the codes NaN.
MIN_SINKHORN_EPSILON = 0.02
# A loss weight multiplies a term that reaches 2**40 (Barlow Twins' squared correlations of a 2**20-wide head); past
# 1e6 the loss or an optimizer's squared gradient overflows float32 (lambda_offdiag=1e38: an inf loss at step 0).
MAX_LOSS_WEIGHT = 1e6


def _label(params: Any) -> str:
    name = type(params).__name__
    return name[: -len("Params")] if name.endswith("Params") else name


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_params(params: Any, *, sizes: Iterable[str] = (), classes: Iterable[str] = (), counts: Iterable[str] = (),
                 positive: Iterable[str] = (), temperatures: Iterable[str] = (), sinkhorn: Iterable[str] = (),
                 non_negative: Iterable[str] = (), unit_interval: Iterable[str] = ()) -> None:
    """Raise `ConfigError` naming the first hyper-parameter of `params` outside its stated range."""
    method = _label(params)

    def fail(name: str, what: str) -> None:
        raise ConfigError(f"{method} parameter {name}={shown(getattr(params, name))} must be {what} "
                          f"(--param {name}=VALUE)")

    for name in sizes:
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
            fail(name, "an integer >= 1" + (" and <= 2**20" if isinstance(value, int) and value > MAX_SIZE else ""))
    for name in classes:
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= MAX_SIZE:
            fail(name, "an integer >= 2" + (" and <= 2**20" if isinstance(value, int) and value > MAX_SIZE else
                                            " (a softmax over one entry is constant: the loss is 0 and nothing trains)"))
    for name in counts:
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
            fail(name, "an integer >= 0" + (" and < 2**64" if isinstance(value, int) and value > 0 else ""))
    for name in positive:
        value = getattr(params, name)
        if not _number(value) or value <= 0:
            fail(name, "a finite number > 0")
    for name in temperatures:
        value = getattr(params, name)
        if not _number(value) or value < MIN_TEMPERATURE:
            fail(name, f"a finite number >= {MIN_TEMPERATURE:g} (logits 1/t past that overflow float32)")
    for name in sinkhorn:
        value = getattr(params, name)
        if not _number(value) or value < MIN_SINKHORN_EPSILON:
            fail(name, f"a finite number >= {MIN_SINKHORN_EPSILON:g} (exp(1/epsilon) past that overflows float32)")
    for name in non_negative:
        value = getattr(params, name)
        if not _number(value) or not 0 <= value <= MAX_LOSS_WEIGHT:
            fail(name, f"a number in [0, {MAX_LOSS_WEIGHT:g}] (a loss weight; larger ones overflow float32)")
    for name in unit_interval:
        value = getattr(params, name)
        if not _number(value) or not 0 <= value <= 1:
            fail(name, "a number in [0, 1]")


def check_trains(params: Any, terms: dict[str, bool]) -> None:
    """`ConfigError` unless one of the loss's `terms` (a description of each, e.g. ``"sim_weight"``, mapped to
    whether it contributes) is on: a loss identically 0 trains nothing, like ``--lr 0``."""
    if not any(terms.values()):
        names = ", ".join(terms)
        raise ConfigError(f"{_label(params)} parameters {names} turn every term of the loss off: the loss is 0 and "
                          f"nothing would train; give one of them a value > 0 (--param NAME=VALUE)")


def check_heads(params: Any, width: str, heads: str) -> None:
    """`ConfigError` unless parameter `width` is a multiple of parameter `heads` (attention splits the width)."""
    w, h = getattr(params, width), getattr(params, heads)
    if isinstance(w, int) and isinstance(h, int) and h >= 1 and w % h:
        raise ConfigError(f"{_label(params)} parameter {width}={w} is not a multiple of {heads}={h} (attention "
                          f"splits the width over the heads); give --param {heads}= a divisor of {w}, e.g. "
                          f"{max(d for d in range(1, min(h, w) + 1) if w % d == 0)}")
