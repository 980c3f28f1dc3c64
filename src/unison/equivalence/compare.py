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
from typing import Any

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


def assert_states_close(a: Any, b: Any, tol: float = 1e-9, where: str = "state") -> None:
    """Assert that two nested states (dicts, lists, tuples of tensors and plain values) are the same.

    Structure, integer tensors and plain values must be equal; a float tensor may differ by
    `tol` relative to ``max(max|b|, 1e-6)``. The AssertionError names the path, e.g.
    ``state.optimizer.state.3.momentum_buffer``.
    """
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.shape == b.shape, f"{where}: shape {getattr(a, 'shape', a)} vs {b.shape}"
        if b.is_floating_point():
            scale = max(float(b.double().abs().max()) if b.numel() else 0.0, 1e-6)
            diff = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
            assert diff / scale <= tol, f"{where}: relative difference {diff / scale:.2e} > {tol:.0e}"
        else:
            assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in b:
            assert_states_close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_states_close(x, y, tol, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
