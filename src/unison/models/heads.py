"""Projection / prediction heads: a configurable MLP, as used by every method."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


def mlp(in_dim: int, hidden_dim: int, out_dim: int, num_layers: int = 2, *, batch_norm: bool = True,
        last_batch_norm: bool = False, last_bn_affine: bool = True, bias_last: bool = True,
        activation: Callable[[], nn.Module] | None = None) -> nn.Sequential:
    """Linear-(BN)-ReLU blocks then a final Linear (optionally followed by BN); `activation` builds another
    activation than ReLU (MSN's GELU).

    SimCLR/MoCo v2: 2 layers; BYOL/SimSiam predictor: 2 layers; SimSiam/Barlow/VICReg projector:
    3 layers, Barlow/SimSiam with a final BN; MSN: 3 layers with BN and GELU.
    """
    if num_layers < 1:
        raise ValueError(f"an MLP needs at least 1 layer, got {num_layers}")
    layers: list[nn.Module] = []
    dim = in_dim
    for _ in range(num_layers - 1):
        layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.ReLU(inplace=True) if activation is None else activation())
        dim = hidden_dim
    layers.append(nn.Linear(dim, out_dim, bias=bias_last and not last_batch_norm))
    if last_batch_norm:
        layers.append(nn.BatchNorm1d(out_dim, affine=last_bn_affine))
    return nn.Sequential(*layers)
