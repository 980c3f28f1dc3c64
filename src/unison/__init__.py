"""unison: distributed self-supervised learning of visual representations, exact under DDP.

``unison.train(cfg)``, ``unison.check(...)`` and ``unison.evaluate(...)`` are the programmatic
API (`unison.api`); they are imported on first use, so ``import unison`` stays light.
"""

from typing import Any

from unison.version import __version__

__all__ = ["__version__", "check", "evaluate", "train"]


def __getattr__(name: str) -> Any:
    if name in ("train", "check", "evaluate"):
        from unison import api

        return getattr(api, name)
    raise AttributeError(f"module 'unison' has no attribute {name!r}")
