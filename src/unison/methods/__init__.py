"""Self-supervised methods. Each is a small module; `METHODS` maps CLI names to classes."""

from __future__ import annotations

from .barlowtwins import BarlowTwins, BarlowTwinsParams
from .base import Recipe, SSLMethod
from .byol import BYOL, BYOLParams
from .dino import DINO, DINOParams
from .moco import MoCo, MoCoParams
from .simclr import SimCLR, SimCLRParams
from .simsiam import SimSiam, SimSiamParams
from .swav import SwAV, SwAVParams
from .vicreg import VICReg, VICRegParams

METHODS: dict[str, type[SSLMethod]] = {
    "simclr": SimCLR,
    "moco": MoCo,
    "byol": BYOL,
    "simsiam": SimSiam,
    "barlowtwins": BarlowTwins,
    "swav": SwAV,
    "vicreg": VICReg,
    "dino": DINO,
}


def get_method(name: str) -> type[SSLMethod]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; use one of {', '.join(sorted(METHODS))}") from None


__all__ = ["BYOL", "BYOLParams", "BarlowTwins", "BarlowTwinsParams", "DINO", "DINOParams", "METHODS", "MoCo",
           "MoCoParams", "Recipe", "SSLMethod", "SimCLR", "SimCLRParams", "SimSiam", "SimSiamParams", "SwAV",
           "SwAVParams", "VICReg", "VICRegParams", "get_method"]
