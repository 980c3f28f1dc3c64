"""unison: distributed self-supervised learning of visual representations, exact under DDP.

The programmatic API (`unison.api`): ``unison.train``, ``check``, ``load_backbone``, ``evaluate``, ``embed`` and
``export``, plain functions with keyword arguments. They are imported on first use, so ``import unison`` stays
light (``help(unison.evaluate)`` shows each one's docstring and example).
"""

from typing import Any

from unison.version import __version__

API = ("check", "embed", "evaluate", "export", "load_backbone", "train")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        from unison import api

        return getattr(api, name)
    raise AttributeError(f"module 'unison' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*API, "__version__"})
