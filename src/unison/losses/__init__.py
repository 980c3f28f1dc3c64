"""Losses: one `nn.Module` per method, each docstring stating its formula and distributed semantics."""

from .barlowtwins import BarlowTwinsLoss
from .byol import BYOLLoss
from .dino import DINOLoss
from .moco import MoCoLoss
from .ntxent import NTXentLoss
from .simsiam import SimSiamLoss
from .swav import SwAVLoss, sinkhorn
from .vicreg import VICRegLoss

__all__ = ["BYOLLoss", "BarlowTwinsLoss", "DINOLoss", "MoCoLoss", "NTXentLoss", "SimSiamLoss", "SwAVLoss",
           "VICRegLoss", "sinkhorn"]
