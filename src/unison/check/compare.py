"""Comparing two runs' tensors: the one relative-difference measure `unison check` and the tests use.

``max_rel_difference(a, b)`` is the largest ``max|a - b| / max(max|b|, floor)`` over the
tensors of `b`, where ``floor = RELATIVE_FLOOR x the largest |b| of the whole dict``. The
floor keeps a tensor whose exact value is zero (the gradient of a bias followed by batch
norm) from measuring its rounding noise against itself. Integer tensors (step counters,
queue pointers) must be equal: any difference is infinite.

Example::

    worst, name = max_rel_difference(multi_grads, single_grads)
    assert worst < 1e-6, f"{name} differs by {worst:.1e}"
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Relative differences are measured against at least this fraction of the largest value compared.
RELATIVE_FLOOR = 1e-3


def max_rel_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       skip: Iterable[str] = ()) -> tuple[float, str]:
    """(largest relative difference, the name where it occurs); keys containing a `skip` string are left out."""
    skip = tuple(skip)
    floats = [v for v in b.values() if v.is_floating_point() and v.numel()]
    scale = max((float(v.double().abs().max()) for v in floats), default=0.0)
    floor = max(RELATIVE_FLOOR * scale, 1e-300)
    worst, where = 0.0, "-"
    for k, ref in b.items():
        if any(s in k for s in skip) or not ref.numel():
            continue
        if k not in a:
            return float("inf"), f"{k} missing"
        if not ref.is_floating_point():
            if not torch.equal(a[k], ref):
                return float("inf"), f"{k} (integer) differs"
            continue
        d = float((a[k].double() - ref.double()).abs().max()) / max(float(ref.double().abs().max()), floor)
        if d > worst:
            worst, where = d, k
    return worst, where
