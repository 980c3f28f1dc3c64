"""unison: distributed self-supervised learning of visual representations, exact under DDP.

The programmatic API (`unison.api`): ``unison.train``, ``check``, ``load_backbone``, ``evaluate``, ``embed`` and
``export``, plain functions with keyword arguments. They are imported on first use, so ``import unison`` stays
light (``help(unison.evaluate)`` shows each one's docstring and example).

``unison.export`` is the function also once the module of the same name (``unison export``'s) is imported: the
import system sets a package's attribute to each submodule it loads, which `_Package` declines for the API's names
(the module stays ``sys.modules["unison.export"]``, what ``from unison.export import ...`` reads).
"""

import sys
import types
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


class _Package(types.ModuleType):
    """The package's module: a submodule named like an API function does not replace the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
