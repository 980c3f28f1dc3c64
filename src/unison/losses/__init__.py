"""Losses: one `nn.Module` per method, each docstring stating its formula and distributed semantics."""

from ._precision import keep_losses_eager
from .barlowtwins import BarlowTwinsLoss
from .byol import BYOLLoss
from .dcl import DCLLoss, DCLWLoss
from .dino import DINOLoss
from .empssl import EMPSSLLoss, coding_rate
from .fastsiam import FastSiamLoss
from .ibot import IBOTLoss
from .ijepa import IJEPALoss
from .koleo import KoLeoLoss
from .lejepa import LeJEPALoss, SIGRegLoss, sigreg_directions
from .mae import MAELoss, patchify
from .mmcr import MMCRLoss
from .moco import MoCoLoss
from .mocov3 import MoCoV3Loss
from .nnclr import NNCLRLoss, nearest_neighbours
from .ntxent import NTXentLoss
from .simsiam import SimSiamLoss
from .smog import SMoGLoss
from .swav import SwAVLoss, sinkhorn
from .tico import TiCoLoss
from .vicreg import VICRegLoss
from .wmse import WMSELoss

__all__ = ["BYOLLoss", "BarlowTwinsLoss", "DCLLoss", "DCLWLoss", "DINOLoss", "EMPSSLLoss", "FastSiamLoss",
           "IBOTLoss", "IJEPALoss", "KoLeoLoss", "LeJEPALoss", "MAELoss", "MMCRLoss", "MoCoLoss", "MoCoV3Loss",
           "NNCLRLoss", "NTXentLoss", "SIGRegLoss", "SMoGLoss", "SimSiamLoss", "SwAVLoss", "TiCoLoss", "VICRegLoss",
           "WMSELoss", "coding_rate", "keep_losses_eager", "nearest_neighbours", "patchify", "sigreg_directions",
           "sinkhorn"]
