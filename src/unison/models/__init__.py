"""Backbones (encoders) and small building blocks shared by the methods."""

from .backbones import BACKBONES, build_backbone
from .heads import mlp

__all__ = ["BACKBONES", "build_backbone", "mlp"]
