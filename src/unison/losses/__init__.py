"""Losses: one `nn.Module` per method, each docstring stating its formula and distributed semantics.

A loss's module is imported when the loss is first named (``from unison.losses import NTXentLoss``): a run
imports the losses of the one method it trains.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._precision import keep_losses_eager

# exported name -> module of this package
_EXPORTS: dict[str, str] = {
    "BarlowTwinsLoss": "barlowtwins",
    "BYOLLoss": "byol",
    "DINOLoss": "dino",
    "IBOTLoss": "ibot",
    "IJEPALoss": "ijepa",
    "KoLeoLoss": "koleo",
    "LeJEPALoss": "lejepa", "SIGRegLoss": "lejepa", "sigreg_directions": "lejepa",
    "MAELoss": "mae", "patchify": "mae", "normalize_patches": "mae",
    "MoCoLoss": "moco",
    "MoCoV3Loss": "mocov3",
    "NTXentLoss": "ntxent",
    "SimSiamLoss": "simsiam",
    "SwAVLoss": "swav", "sinkhorn": "swav", "sinkhorn_balance": "swav",
    "VICRegLoss": "vicreg",
    "DCLLoss": "dcl", "DCLWLoss": "dcl",
    "FastSiamLoss": "fastsiam",
    "NNCLRLoss": "nnclr", "nearest_neighbours": "nnclr",
    "TiCoLoss": "tico",
    "EMPSSLLoss": "empssl", "coding_rate": "empssl",
    "MMCRLoss": "mmcr",
    "SMoGLoss": "smog",
    "WMSELoss": "wmse",
    "VICRegLLoss": "vicregl",
    "DenseCLLoss": "densecl",
    "MSNLoss": "msn",
    "PMSNLoss": "pmsn",
    "SimMIMLoss": "simmim",
    "AIMLoss": "aim",
    "CAPILoss": "capi", "positionwise_sinkhorn": "capi",
    "GramAnchoringLoss": "gram", "gram_matrix": "gram",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["keep_losses_eager", *sorted(_EXPORTS)]
