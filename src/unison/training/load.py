"""Load a trained method from a checkpoint, rebuilt as the training step built it: what `unison eval` and
`unison export` start from.

Example::

    method, cfg, ckpt = load_method("runs/default", device="cpu")
    features = method.backbone(images)
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn

from unison.config import TrainConfig
from unison.config.distributed import checked_device
from unison.errors import ConfigError
from unison.methods.base import SSLMethod
from unison.models.backbones import resolve_backbone
from unison.paths import Input
from unison.training.checkpoint import check_compatible, load_checkpoint
from unison.training.checkpoint.compat import state_differences
from unison.training.checkpoint.files import CHECKPOINT_DIR, checkpoint_dir

from .model import build_method
from .pieces import OWN


def preprocessing(cfg: Any, ckpt: dict[str, Any]) -> dict[str, Any]:
    """What a user of the exported backbone must feed it: image size and the training set's mean/std.

    From the checkpoint's resolved values; a checkpoint written before they were recorded has the
    configured image size only (mean/std None). A run with the user's own transform (``transform``: its name)
    was fed what that transform makes: its normalisation, not unison's (mean/std None)."""
    resolved = ckpt.get("resolved") or {}
    if resolved.get("transform"):
        return {"image_size": resolved.get("image_size", cfg.image_size), "mean": None, "std": None,
                "transform": str(resolved["transform"])}
    return {"image_size": resolved.get("image_size", cfg.image_size), "mean": resolved.get("mean"),
            "std": resolved.get("std")}


def checkpoint_inputs(checkpoint: str | Path) -> list[Input]:
    """What reading `checkpoint` (a run directory or a checkpoint) reads, for `unison.paths.check_output`: the path
    itself and the run's ``checkpoints/`` folder, where a file of another command would be taken for a checkpoint."""
    path = Path(checkpoint)
    sharded = path.is_dir() and path.name.endswith(".dcp")
    inputs = [Input("--checkpoint", path, tree=sharded)]
    folder = checkpoint_dir(path) if path.is_dir() and not sharded else path.parent
    if folder.name == CHECKPOINT_DIR:
        inputs.append(Input("the checkpoints of --checkpoint", folder, tree=True))
    return inputs


def own_backbone_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The backbone's own state dict in a checkpoint of a run with the user's backbone (``unison.train(...,
    backbone=...)``, named ``own:...``), which unison cannot rebuild; None for unison's backbones."""
    if not str((ckpt.get("config") or {}).get("backbone") or "").startswith(OWN):
        return None
    prefix = "backbone."   # the method's online backbone (`SSLMethod.backbone`)
    return {k[len(prefix):]: v for k, v in ckpt["model"].items() if k.startswith(prefix)}


def load_method(checkpoint: str | Path, device: torch.device | str = "cpu", *,
                backbone: nn.Module | None = None) -> tuple[SSLMethod, TrainConfig, dict]:
    """Rebuild the method of a checkpoint as `unison train` built it and load its weights.

    Returns ``(method in eval mode, TrainConfig, checkpoint dict)``. Plain batch norm is
    used (SyncBN has the same state-dict keys). `backbone`: a module that becomes the method's backbone with the
    run's backbone weights: an instance of the user's own backbone class, for a run that trained one (else its class
    is imported and built without arguments: `own_backbone`); for a run of unison's backbones, any module whose
    state dict has exactly the keys and shapes of the trained one (`load_trained_backbone`). `device`: checked
    first (`checked_device`), so a device that is not one, or not here, is said as such.
    Raises `CheckpointError` / `ConfigError`.
    """
    device = checked_device(device, "device")
    ckpt = load_checkpoint(checkpoint, map_location=device, run=True)   # every field checked, the config too
    return method_of(checkpoint, ckpt, device, backbone=backbone), config_of(ckpt), ckpt


def own_backbone(checkpoint: str | Path, name: str, given: nn.Module | None) -> nn.Module:
    """The user's backbone of a run that trained one (`name`: ``module.Class``): `given`, else the class imported
    from its module and built without arguments. Only an ``nn.Module`` subclass is ever called: a checkpoint
    cannot name another callable. `ConfigError` (one line) when it cannot be imported or built."""
    if given is not None:
        if not isinstance(given, nn.Module):
            raise ConfigError(f"backbone= is {type(given).__name__}; give an instance of {name} (a torch.nn.Module)")
        return given
    module_name, _, qualname = name.rpartition(".")
    hint = f"pass an instance: unison.evaluate(RUN, backbone={qualname}(...)) or unison.load_backbone(RUN, backbone=...)"
    if not module_name or module_name == "__main__":
        raise ConfigError(f"{checkpoint} trained your own backbone {name}, defined in the script that trained it, "
                          f"which cannot be imported from here: move the class into a module, or {hint}")
    try:
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except Exception as e:   # ImportError, AttributeError, or the module's own failure
        raise ConfigError(f"{checkpoint} trained your own backbone {name}, which cannot be imported here "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): put its module on "
                          f"PYTHONPATH, or {hint}") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"{checkpoint} names {name} as its backbone, which is not a torch.nn.Module class")
    try:
        return cast(nn.Module, cls())
    except Exception as e:
        raise ConfigError(f"{name}() fails ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): its "
                          f"class takes arguments unison cannot know; {hint}") from None


def config_of(ckpt: dict[str, Any]) -> TrainConfig:
    """The configuration of a checkpoint's run (read by `load_checkpoint`), with the backbone as trained."""
    cfg = TrainConfig.from_dict(dict(ckpt["config"]))
    # The backbone as trained: runs record the pinned name (resnet18 -> resnet18_imagenet at 224 px); before
    # that was recorded, resnet18/resnet50 always had the CIFAR stem, which resolve_backbone(name, None) gives.
    pinned = (ckpt.get("resolved") or {}).get("backbone")
    cfg.backbone = pinned or (resolve_backbone(cfg.backbone, None) if cfg.backbone else None)
    return cfg


def method_of(checkpoint: str | Path, ckpt: dict[str, Any], device: torch.device | str = "cpu", *,
              backbone: nn.Module | None = None) -> SSLMethod:
    """The method of `ckpt` (read from `checkpoint` by `load_checkpoint`) with its weights, in eval mode; a run
    of the user's own backbone is rebuilt around `backbone` or its class (`own_backbone`)."""
    cfg = config_of(ckpt)
    own = None
    if own_backbone_weights(ckpt) is not None:
        feature_dim = (ckpt.get("resolved") or {}).get("feature_dim")
        if type(feature_dim) is not int or feature_dim < 1:
            raise ConfigError(f"{checkpoint} trained your own backbone but does not record its feature_dim (an older "
                              "run): unison export writes its state_dict for your module")
        own = (own_backbone(checkpoint, str(cfg.backbone)[len(OWN):], backbone), feature_dim)
    try:  # the method as the training step built it; steps_total only shapes training-time schedules
        method = build_method(cfg, max(1, int(ckpt["step"])), getattr(torch, cfg.precision), torch.device(device),
                              image_size=preprocessing(cfg, ckpt)["image_size"], teacher_weights=False, own=own)
    except ValueError as e:  # a method this unison lacks, a timm backbone without timm installed, ...
        raise ConfigError(str(e)) from None
    check_compatible(method, ckpt.get("model"), checkpoint)
    method.load_state_dict(ckpt["model"])
    if backbone is not None and own is None:   # unison's backbone: its trained weights go into the module given
        method.backbone = load_trained_backbone(backbone, method.backbone, checkpoint, str(cfg.backbone), device)
    return method.eval()


def load_trained_backbone(given: Any, trained: nn.Module, checkpoint: str | Path, name: str,
                          device: torch.device | str) -> nn.Module:
    """`given` (the caller's module) with the weights of `trained` (the run's backbone `name`) loaded strictly, on
    `device`: every key and shape must agree (a `ConfigError` naming the differences, in one line, when not), so
    that a module of another architecture never passes for the run's. Its class is the caller's: what it computes
    from those weights is its own ``forward``."""
    if not isinstance(given, nn.Module):
        raise ConfigError(f"backbone= is {type(given).__name__}; give a torch.nn.Module to load the weights of "
                          f"{checkpoint}'s backbone {name} into, or leave backbone= out for the run's own")
    weights = trained.state_dict()
    differences = state_differences(given, weights, where=f"the run's {name}", into="backbone=")
    if differences:
        raise ConfigError(f"backbone= ({type(given).__name__}) does not fit the trained backbone of {checkpoint} "
                          f"({name}): {'; '.join(differences)}; give a module with the same state_dict keys and "
                          "shapes (unison export writes them), or leave backbone= out for the run's own")
    given.load_state_dict(weights)
    return given.to(device)
