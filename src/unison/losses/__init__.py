"""Losses: one `nn.Module` per method, each docstring stating its formula and distributed semantics."""

from ._precision import keep_losses_eager
from .barlowtwins import BarlowTwinsLoss
from .byol import BYOLLoss
from .dino import DINOLoss
from .ibot import IBOTLoss
from .ijepa import IJEPALoss
from .koleo import KoLeoLoss
from .lejepa import LeJEPALoss, SIGRegLoss, sigreg_directions
from .mae import MAELoss, patchify
from .moco import MoCoLoss
from .mocov3 import MoCoV3Loss
from .ntxent import NTXentLoss
from .simsiam import SimSiamLoss
from .swav import SwAVLoss, sinkhorn
from .vicreg import VICRegLoss

__all__ = ["BYOLLoss", "BarlowTwinsLoss", "DINOLoss", "IBOTLoss", "IJEPALoss", "KoLeoLoss", "LeJEPALoss", "MAELoss",
           "MoCoLoss", "MoCoV3Loss", "NTXentLoss", "SIGRegLoss", "SimSiamLoss", "SwAVLoss", "VICRegLoss",
           "keep_losses_eager", "patchify", "sigreg_directions", "sinkhorn"]
