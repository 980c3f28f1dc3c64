"""Random-number-generator state in checkpoints: packed as plain data, restored in one place.

`pack_rng_state` captures Python `random`, numpy (if importable) and torch CPU (+ CUDA) states as
tensors and plain values, so checkpoints still load with ``weights_only=True``. A run checkpoint
holds every rank's state (gathered); `restore_run_rng` is the one restore both kinds of checkpoint
(``.pt`` and ``.dcp``) use on resume: each rank gets its own state back when the world size is
unchanged, so a resumed run draws exactly what the uninterrupted one would have drawn.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from unison.distributed import collectives as C
from unison.errors import CheckpointError

from .safe_load import short_reason


def pack_rng_state() -> dict:
    """Python `random`, numpy (if importable) and torch CPU (+ CUDA) RNG states, as plain data.

    Arrays are stored as int64 tensors so the result loads with ``weights_only=True``.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        legacy_state = np.random.get_state(legacy=True)
        assert isinstance(legacy_state, tuple)   # legacy=True: the global MT19937's (name, keys, pos, gauss, cached)
        name, keys, pos, has_gauss, cached = legacy_state
        state["numpy"] = {"bit_generator": str(name), "state": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def _words(t: Any, n: int) -> bool:
    """A 1-D integer tensor of `n` unsigned 32-bit words (a Mersenne Twister's state)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == n and not t.is_floating_point()
            and t.dtype != torch.bool and bool(((t >= 0) & (t < 2**32)).all()))


def _float_or_none(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and math.isfinite(v))


def rng_problem(d: Any) -> str | None:
    """What is wrong with `d` as a `pack_rng_state` dict (None: nothing), checked before any generator is set."""
    if not isinstance(d, dict):
        return f"{type(d).__name__}, not the dict from pack_rng_state()"
    py, np_state, cuda = d.get("python"), d.get("numpy"), d.get("cuda")
    if py is not None and not (isinstance(py, dict) and py.get("version") == 3 and _words(py.get("state"), 625)
                               and int(py["state"][-1]) <= 624 and _float_or_none(py.get("gauss_next"))):
        return "python: not Python's random state (version 3, 625 words, gauss_next)"
    t = d.get("torch")
    if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                              and t.shape == torch.get_rng_state().shape):
        return f"torch: not torch's CPU generator state ({torch.get_rng_state().numel()} bytes)"
    if np_state is not None and not (isinstance(np_state, dict) and np_state.get("bit_generator") == "MT19937"
                                     and _words(np_state.get("state"), 624)
                                     and type(np_state.get("pos")) is int and 0 <= np_state["pos"] <= 624
                                     and np_state.get("has_gauss") in (0, 1) and type(np_state["has_gauss"]) is int
                                     and _float_or_none(np_state.get("cached_gaussian"))):
        return "numpy: not numpy's MT19937 state (624 words, pos, has_gauss, cached_gaussian)"
    if cuda is not None and not (type(cuda) in (list, tuple) and len(cuda) <= 4096 and all(
            isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1 and s.numel() <= 1024
            for s in cuda)):
        return "cuda: not a list of CUDA generator states"
    return None


def restore_rng_state(d: dict) -> None:
    """Restore what `pack_rng_state` saved. Parts this process cannot use are skipped.

    (numpy state without numpy installed, CUDA state without CUDA; CUDA states are
    restored for as many devices as both the checkpoint and this machine have.)
    """
    problem = rng_problem(d)
    if problem:
        raise CheckpointError(f"RNG state is malformed ({problem}); pass the dict from pack_rng_state()")
    try:
        if "python" in d:
            py = d["python"]
            random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        if "torch" in d:
            torch.set_rng_state(d["torch"].cpu().to(torch.uint8))
        if "numpy" in d:
            try:
                import numpy as np
            except ImportError:
                pass
            else:
                n = d["numpy"]
                keys = n["state"].cpu().numpy().astype(np.uint32)
                np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
        if "cuda" in d and torch.cuda.is_available():
            states = d["cuda"][: torch.cuda.device_count()]
            for i, s in enumerate(states):
                torch.cuda.set_rng_state(s.cpu().to(torch.uint8), i)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"RNG state is malformed ({short_reason(e)}); pass the dict from pack_rng_state()") from e


def restore_run_rng(ckpt: dict[str, Any]) -> None:
    """This rank's RNG state from a run checkpoint's ``rng`` (one state per rank), at the same world size only.

    At another world size the saved states belong to another set of ranks: none is restored (the
    generators keep their seeded state)."""
    rank, world = C.rank(), C.world_size()
    if ckpt.get("rng") is not None and world == ckpt.get("world_size"):
        restore_rng_state(ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0])
