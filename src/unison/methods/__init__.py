"""Self-supervised methods. Each is a small module; `METHODS` maps CLI names to classes."""

from __future__ import annotations

from .base import Recipe, SSLMethod
from .simclr import SimCLR, SimCLRParams

METHODS: dict[str, type[SSLMethod]] = {
    "simclr": SimCLR,
}


def get_method(name: str) -> type[SSLMethod]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; use one of {', '.join(sorted(METHODS))}") from None


__all__ = ["METHODS", "Recipe", "SSLMethod", "SimCLR", "SimCLRParams", "get_method"]
