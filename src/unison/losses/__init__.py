"""Losses: one `nn.Module` per method, each docstring stating its formula and distributed semantics."""

from .ntxent import NTXentLoss

__all__ = ["NTXentLoss"]
