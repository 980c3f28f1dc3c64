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

Ranges: ``sizes`` integers in [1, 2**20] (dimensions, counts); ``counts`` integers >= 0; ``positive``
finite numbers > 0 (temperatures, scales); ``non_negative`` finite numbers >= 0 (loss
weights); ``unit_interval`` numbers in [0, 1] (momenta, probabilities, fractions).
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


def _label(params: Any) -> str:
    name = type(params).__name__
    return name[: -len("Params")] if name.endswith("Params") else name


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_params(params: Any, *, sizes: Iterable[str] = (), counts: Iterable[str] = (), positive: Iterable[str] = (),
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
    for name in counts:
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
            fail(name, "an integer >= 0" + (" and < 2**64" if isinstance(value, int) and value > 0 else ""))
    for name in positive:
        value = getattr(params, name)
        if not _number(value) or value <= 0:
            fail(name, "a finite number > 0")
    for name in non_negative:
        value = getattr(params, name)
        if not _number(value) or value < 0:
            fail(name, "a finite number >= 0")
    for name in unit_interval:
        value = getattr(params, name)
        if not _number(value) or not 0 <= value <= 1:
            fail(name, "a number in [0, 1]")


def check_heads(params: Any, width: str, heads: str) -> None:
    """`ConfigError` unless parameter `width` is a multiple of parameter `heads` (attention splits the width)."""
    w, h = getattr(params, width), getattr(params, heads)
    if isinstance(w, int) and isinstance(h, int) and h >= 1 and w % h:
        raise ConfigError(f"{_label(params)} parameter {width}={w} is not a multiple of {heads}={h} (attention "
                          f"splits the width over the heads); give --param {heads}= a divisor of {w}, e.g. "
                          f"{max(d for d in range(1, min(h, w) + 1) if w % d == 0)}")
