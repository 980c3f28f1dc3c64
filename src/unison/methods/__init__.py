"""Self-supervised methods. Each is a small module; `METHODS` maps CLI names to classes.

`METHODS` imports a method's module when the method is first looked up, not before: a run imports the one method
it trains, and listing the names (``sorted(METHODS)``, ``name in METHODS``) imports none. Adding a method means
one line in `_MODULES`, one method module and one loss module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from unison.errors import ConfigError

from .base import Recipe, SampleKeys, SSLMethod

# CLI name -> (module of this package, method class); the Params class is the method's `Params`
_MODULES: dict[str, tuple[str, str]] = {
    "simclr": ("simclr", "SimCLR"),
    "moco": ("moco", "MoCo"),
    "byol": ("byol", "BYOL"),
    "simsiam": ("simsiam", "SimSiam"),
    "barlowtwins": ("barlowtwins", "BarlowTwins"),
    "swav": ("swav", "SwAV"),
    "vicreg": ("vicreg", "VICReg"),
    "dino": ("dino", "DINO"),
    "mae": ("mae", "MAE"),
    "ibot": ("ibot", "IBOT"),
    "ijepa": ("ijepa", "IJEPA"),
    "lejepa": ("lejepa", "LeJEPA"),
    "mocov3": ("mocov3", "MoCoV3"),
    "distill": ("distill", "Distill"),
    "nnclr": ("nnclr", "NNCLR"),
    "dcl": ("dcl", "DCL"),
    "dclw": ("dcl", "DCLW"),
    "tico": ("tico", "TiCo"),
    "fastsiam": ("fastsiam", "FastSiam"),
    "mmcr": ("mmcr", "MMCR"),
    "wmse": ("wmse", "WMSE"),
    "smog": ("smog", "SMoG"),
    "empssl": ("empssl", "EMPSSL"),
    "vicregl": ("vicregl", "VICRegL"),
    "densecl": ("densecl", "DenseCL"),
    "msn": ("msn", "MSN"),
    "pmsn": ("pmsn", "PMSN"),
    "simmim": ("simmim", "SimMIM"),
    "aim": ("aim", "AIM"),
    "capi": ("capi", "CAPI"),
    "dinov2": ("dinov2", "DINOv2"),
    "dinov3": ("dinov3", "DINOv3"),
}


class _Methods(Mapping[str, type[SSLMethod]]):
    """The method registry: a read-only mapping whose values are imported on first access."""

    def __getitem__(self, name: str) -> type[SSLMethod]:
        module, cls = _MODULES[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)

    def __contains__(self, name: object) -> bool:
        return name in _MODULES


METHODS: Mapping[str, type[SSLMethod]] = _Methods()


def get_method(name: str) -> type[SSLMethod]:
    if name not in _MODULES:
        raise ConfigError(f"method {name!r} is unknown; use one of {', '.join(sorted(_MODULES))}")
    return METHODS[name]


# The classes by their own names (``from unison.methods import BYOL``), imported when first named
_EXPORTS: dict[str, tuple[str, str]] = {
    **{cls: (module, cls) for module, cls in _MODULES.values()},
    **{f"{cls}Params": (module, f"{cls}Params") for module, cls in _MODULES.values()},
    "MomentumTeacher": ("teacher", "MomentumTeacher"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


__all__ = ["METHODS", "Recipe", "SSLMethod", "SampleKeys", "get_method", *sorted(_EXPORTS)]
