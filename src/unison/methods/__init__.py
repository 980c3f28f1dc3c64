"""Self-supervised methods. Each is a small module; `METHODS` maps CLI names to classes."""

from __future__ import annotations

from unison.errors import ConfigError

from .barlowtwins import BarlowTwins, BarlowTwinsParams
from .base import Recipe, SampleKeys, SSLMethod
from .byol import BYOL, BYOLParams
from .dcl import DCL, DCLW, DCLParams, DCLWParams
from .dino import DINO, DINOParams
from .distill import Distill, DistillParams
from .empssl import EMPSSL, EMPSSLParams
from .fastsiam import FastSiam, FastSiamParams
from .ibot import IBOT, IBOTParams
from .ijepa import IJEPA, IJEPAParams
from .lejepa import LeJEPA, LeJEPAParams
from .mae import MAE, MAEParams
from .mmcr import MMCR, MMCRParams
from .moco import MoCo, MoCoParams
from .mocov3 import MoCoV3, MoCoV3Params
from .nnclr import NNCLR, NNCLRParams
from .simclr import SimCLR, SimCLRParams
from .simsiam import SimSiam, SimSiamParams
from .smog import SMoG, SMoGParams
from .swav import SwAV, SwAVParams
from .teacher import MomentumTeacher
from .tico import TiCo, TiCoParams
from .vicreg import VICReg, VICRegParams
from .wmse import WMSE, WMSEParams

METHODS: dict[str, type[SSLMethod]] = {
    "simclr": SimCLR,
    "moco": MoCo,
    "byol": BYOL,
    "simsiam": SimSiam,
    "barlowtwins": BarlowTwins,
    "swav": SwAV,
    "vicreg": VICReg,
    "dino": DINO,
    "mae": MAE,
    "ibot": IBOT,
    "ijepa": IJEPA,
    "lejepa": LeJEPA,
    "mocov3": MoCoV3,
    "distill": Distill,
    "nnclr": NNCLR,
    "dcl": DCL,
    "dclw": DCLW,
    "tico": TiCo,
    "fastsiam": FastSiam,
    "mmcr": MMCR,
    "wmse": WMSE,
    "smog": SMoG,
    "empssl": EMPSSL,
}


def get_method(name: str) -> type[SSLMethod]:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"method {name!r} is unknown; use one of {', '.join(sorted(METHODS))}") from None


__all__ = ["BYOL", "DCL", "DCLW", "EMPSSL", "IBOT", "IJEPA", "MAE", "MMCR", "NNCLR", "WMSE", "BYOLParams",
           "BarlowTwins", "BarlowTwinsParams", "DCLParams", "DCLWParams", "DINO", "DINOParams", "Distill",
           "DistillParams", "EMPSSLParams", "FastSiam", "FastSiamParams", "IBOTParams", "IJEPAParams", "LeJEPA",
           "LeJEPAParams", "MAEParams", "METHODS", "MMCRParams", "MoCo", "MoCoParams", "MoCoV3", "MoCoV3Params",
           "MomentumTeacher", "NNCLRParams", "Recipe", "SMoG", "SMoGParams", "SSLMethod", "SampleKeys", "SimCLR",
           "SimCLRParams", "SimSiam", "SimSiamParams", "SwAV", "SwAVParams", "TiCo", "TiCoParams", "VICReg",
           "VICRegParams", "WMSEParams", "get_method"]
