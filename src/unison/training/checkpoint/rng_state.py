"""Random-number-generator state in checkpoints: packed as plain data, restored in one place.

`pack_rng_state` captures Python `random`, numpy (if importable) and torch CPU (+ CUDA) states as
tensors and plain values, so checkpoints still load with ``weights_only=True``. A run checkpoint
holds every rank's state (gathered); `restore_run_rng` is the one restore both kinds of checkpoint
(``.pt`` and ``.dcp``) use on resume: each rank gets its own state back when the world size is
unchanged, so a resumed run draws exactly what the uninterrupted one would have drawn.
"""

from __future__ import annotations

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


def restore_rng_state(d: dict) -> None:
    """Restore what `pack_rng_state` saved. Parts this process cannot use are skipped.

    (numpy state without numpy installed, CUDA state without CUDA; CUDA states are
    restored for as many devices as both the checkpoint and this machine have.)
    """
    if not isinstance(d, dict):
        raise CheckpointError(f"RNG state must be the dict from pack_rng_state(), got {type(d).__name__}")
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
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"RNG state is malformed ({short_reason(e)}); pass the dict from pack_rng_state()") from e


def restore_run_rng(ckpt: dict[str, Any]) -> None:
    """This rank's RNG state from a run checkpoint's ``rng`` (one state per rank), at the same world size only.

    At another world size the saved states belong to another set of ranks: none is restored (the
    generators keep their seeded state)."""
    rank, world = C.rank(), C.world_size()
    if ckpt.get("rng") is not None and world == ckpt.get("world_size"):
        restore_rng_state(ckpt["rng"][rank] if rank < len(ckpt["rng"]) else ckpt["rng"][0])
