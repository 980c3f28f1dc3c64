"""Backbones (encoders) and small building blocks shared by the methods."""

from .backbones import BACKBONES, build_backbone
from .heads import mlp
from .vit import VIT_BACKBONES, ViT

__all__ = ["BACKBONES", "VIT_BACKBONES", "ViT", "build_backbone", "mlp"]
