"""Write the trained backbone as a plain state dict, which loads without unison (into torchvision or timm).

The method is rebuilt from the checkpoint's stored configuration and the checkpoint is
loaded into it (so a mismatched or damaged file fails here, with a one-line message, not
in the user's code later). The file holds the backbone's own ``state_dict()`` — tensors
only, keys exactly as the backbone module names them (``conv1.weight``,
``layer1.0.bn1.running_mean``, ...; no ``backbone.`` prefix, no heads, no momentum
encoder: for BYOL/MoCo/DINO the *online* backbone is exported) — as ``torch.save`` (.pt)
or safetensors (``pip install safetensors``; not a dependency of unison). Beside it,
``<name>.json`` records what the backbone expects as input — the image size and the
training set's per-channel mean/std (``x = (pixels / 255 - mean) / std``) — with the
method, backbone and step, and under ``load`` the call that takes the weights without unison, with every argument
they need (`load_call`: ``timm.create_model('vit_tiny_patch16_224', num_classes=0, patch_size=4, img_size=32)``;
unison's ViTs are timm's ``VisionTransformer``); a safetensors file carries the same in its metadata.

An existing ``--out`` or sidecar is replaced only with ``--overwrite`` (every command's rule: an earlier export is
no exception, whose run it came from the command cannot know), and never the checkpoint read or a file in its run's
``checkpoints/`` folder; ``--out x.json`` is refused, its sidecar would be the same file
(`unison.paths.check_output`).

ResNets trained above 64 px (``resnet18_imagenet``) are torchvision's without ``fc``: the export
loads into ``torchvision.models.resnet18()`` as is, with only ``fc.*`` missing. The CIFAR ResNets
(``resnet18_cifar``, what ``resnet18`` is at 64 px and below) have a 3x3 stride-1 ``conv1`` and no
max-pool, so the export loads into torchvision after the same stem surgery::

    unison export --checkpoint runs/cifar --out r18.pt

    m = torchvision.models.resnet18()
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    missing, unexpected = m.load_state_dict(torch.load("r18.pt"), strict=False)  # missing: fc.weight, fc.bias
    m.fc = torch.nn.Identity()                                                    # features, as in unison

`unison.training.load.load_method` (checkpoint -> method with its weights) is shared with ``unison eval``.
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.errors import ConfigError
from unison.models.backbones import timm_create_kwargs
from unison.models.vit import VIT_BACKBONES, vit_timm_kwargs
from unison.paths import OVERWRITE_HELP, check_output, write_error
from unison.training.load import checkpoint_inputs, config_of, method_of, own_backbone_weights, preprocessing

if TYPE_CHECKING:   # annotations only: the functions import the training stack when called
    from unison.methods.base import SSLMethod

FORMATS = ("pt", "safetensors")


@dataclass
class ExportOptions:
    checkpoint: str | None = field(default=None, metadata={
        "help": "run directory (its latest checkpoint) or checkpoint file; required", "required": True, "metavar": "RUN_DIR_OR_FILE"})
    out: str | None = field(default=None, metadata={"help": "file to write, e.g. backbone.pt; required",
                                                     "required": True, "metavar": "FILE"})
    format: str | None = field(default=None, metadata={
        "help": "pt (torch.save) or safetensors; default: safetensors if FILE ends in .safetensors, else pt",
        "choices": FORMATS})
    overwrite: bool = field(default=False, metadata={"help": OVERWRITE_HELP + " (FILE and its .json sidecar)"})


def backbone_state_dict(method: SSLMethod) -> dict[str, torch.Tensor]:
    """The backbone's own state dict as independent, contiguous CPU tensors (no shared storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in method.backbone.state_dict().items()}


def _resolve_format(out: Path, fmt: str | None) -> str:
    if fmt is None:
        return "safetensors" if out.suffix == ".safetensors" else "pt"
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is unknown; use pt or safetensors")
    return fmt


def write_state_dict(state: dict[str, torch.Tensor], out: str | Path, fmt: str | None = None,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write `state` atomically (temporary sibling + rename) as .pt or safetensors; returns the path."""
    out = Path(out)
    fmt = _resolve_format(out, fmt)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / ('backbone.' + fmt)}")
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ConfigError("--format safetensors needs the safetensors package: pip install safetensors "
                              "(or use --format pt)") from None
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "safetensors":
            save_file(state, str(tmp), metadata=metadata)
        else:
            _torch_save(state, tmp)
        os.chmod(tmp, 0o666 & ~_umask())   # safetensors writes 0600; an export is shared like any file (0644)
        os.replace(tmp, out)  # a reader never sees a half-written file
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):   # a full disk, a read-only folder, a file where a folder should be: one line
            raise write_error(out, e) from None
        raise
    return out


def _torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save through `atomic_write`'s writer, which keeps the real OSError (torch's zip writer reports a full
    disk as ``unexpected pos``)."""
    from unison.training.checkpoint.files import atomic_write

    atomic_write(path, lambda f: torch.save(state, f))


def is_export(path: Path) -> bool:
    """`path` is an earlier export (weights or sidecar): the sidecar ``<stem>.json`` says so and names it."""
    import json

    sidecar = path.with_suffix(".json")
    try:
        if not sidecar.is_file() or sidecar.stat().st_size > 1 << 20:
            return False
        info = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("unison") == "backbone" and (path == sidecar or info.get("file") == path.name)


def check_export_paths(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
    """The weights file and its sidecar, refused (one line) where they would replace an input, each other or, without
    `overwrite`, an existing file (`unison.paths.check_output`)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'backbone.pt'}")
    sidecar = out.with_suffix(".json")
    inputs = checkpoint_inputs(checkpoint)
    own_text = "an earlier unison export"
    if out.suffix == ".json":   # the sidecar <name>.json would be the weights file itself
        raise ConfigError(f"--out {out} would be its own sidecar (the .json beside the weights, which records their "
                          f"preprocessing); name the weights file {out.with_suffix('.pt')} or "
                          f"{out.with_suffix('.safetensors')}")
    check_output(out, "--out", inputs=inputs, overwrite=overwrite, own=is_export, own_text=own_text)
    check_output(sidecar, "--out", inputs=inputs, overwrite=overwrite, own=is_export, own_text=own_text,
                 label=f"the sidecar {sidecar} of --out {out}")
    return out, sidecar


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_backbone(checkpoint: str | Path, out: str | Path, fmt: str | None = None, *,
                    overwrite: bool = False) -> dict[str, Any]:
    """Export the backbone of `checkpoint` to `out`, with its preprocessing in ``<out stem>.json`` (and, for
    safetensors, in the file's metadata); return a description (path, format, counts, backbone, preprocessing)."""
    import json

    from unison.paths import write_text_atomic
    from unison.version import __version__

    fmt = _resolve_format(Path(out), fmt)
    from unison.training.checkpoint import load_checkpoint

    out, sidecar = check_export_paths(checkpoint, out, overwrite)   # before the (slow) load: refused without work
    ckpt = load_checkpoint(checkpoint, map_location="cpu", run=True)   # every field checked, the config too
    cfg = config_of(ckpt)
    own = own_backbone_weights(ckpt)   # the user's backbone: its weights as trained, for their module
    method = method_of(checkpoint, ckpt) if own is None else None
    state = backbone_state_dict(method) if method is not None else {k: v.detach().contiguous().clone()
                                                                     for k, v in (own or {}).items()}
    feature_dim = method.feature_dim if method is not None else (ckpt.get("resolved") or {}).get("feature_dim")
    info = {"unison": "backbone", "unison_version": __version__, "method": str(ckpt["method"]),
            "backbone": cfg.backbone, "backbone_args": dict(cfg.backbone_args), "step": int(ckpt["step"]),
            "feature_dim": None if feature_dim is None else int(feature_dim), **preprocessing(cfg, ckpt)}
    info["load"] = load_call(cfg.backbone or "", info["image_size"], dict(cfg.backbone_args))
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}   # safetensors: strings only
    # The sidecar first: it is what marks the weights file as this command's own output (`is_export`).
    write_text_atomic(sidecar, json.dumps({**info, "file": out.name, "format": fmt}, indent=2) + "\n")
    path = write_state_dict(state, out, fmt, metadata=meta)  # metadata: safetensors only (.pt is tensors only)
    n_params = sum(p.numel() for p in method.backbone.parameters()) if method is not None else \
        sum(v.numel() for k, v in state.items() if v.is_floating_point() and "running_" not in k)
    return {**info, "path": str(path), "sidecar": str(sidecar), "format": fmt, "tensors": len(state),
            "parameters": n_params}


def load_call(backbone: str, image_size: int | None, backbone_args: dict[str, Any]) -> str:
    """How to load the exported weights of `backbone` without unison: a call with every argument they need (a timm
    model's ``img_size`` and ``--backbone-arg`` values, a unison ViT's timm ``VisionTransformer`` arguments)."""
    if backbone.endswith("_imagenet"):
        return f"torchvision.models.{backbone[:-9]}() with strict=False (only fc.* is missing)"
    if backbone.endswith("_cifar"):
        return (f"torchvision.models.{backbone[:-6]}() after conv1 = Conv2d(3, 64, 3, 1, 1, bias=False) and "
                "maxpool = Identity(), with strict=False (only fc.* is missing)")
    if backbone.startswith("timm:"):
        kwargs = timm_create_kwargs(backbone[5:], image_size, backbone_args)
        return f"timm.create_model({backbone[5:]!r}, {_arguments(kwargs)})"
    if backbone in VIT_BACKBONES:   # timm's blocks and parameter names (unison.models.vit)
        return f"timm.models.vision_transformer.VisionTransformer({_arguments(vit_timm_kwargs(backbone))})"
    if backbone.startswith("own:"):   # unison.training.pieces.OWN: the user's backbone
        return f"your {backbone[4:]} with load_state_dict"
    return f"unison.models.build_backbone({backbone!r})[0]"


def _arguments(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _fmt3(values: list[float]) -> str:
    return "(" + ", ".join(f"{v:.4f}" for v in values) + ")"


def cmd_export(ns: argparse.Namespace) -> int:
    from unison.config.fields import overrides_from_namespace

    opts = ExportOptions(**overrides_from_namespace(ns, ExportOptions))
    if not opts.checkpoint or not opts.out:
        raise ConfigError("give --checkpoint RUN_DIR_OR_FILE and --out FILE, e.g. "
                          "unison export --checkpoint runs/default --out backbone.pt")
    # a refused checkpoint: CheckpointError, exit 4
    info = export_backbone(opts.checkpoint, opts.out, opts.format, overwrite=opts.overwrite)
    norm = (f"normalise with mean {_fmt3(info['mean'])}, std {_fmt3(info['std'])}" if info["mean"] is not None
            else f"normalised as your transform {info['transform'][4:]} does" if info.get("transform")
            else "mean/std not recorded in this checkpoint")
    print(f"exported the {info['backbone']} backbone of {info['method']} (step {info['step']}; {info['tensors']} "
          f"tensors, {info['parameters'] / 1e6:.2f}M parameters) to {info['path']} ({info['format']}); "
          f"load into {info['load']}; inputs {info['image_size']} px, {norm} (also in {info['sidecar']})")
    return 0


def add_subcommand(sub: argparse._SubParsersAction, help_text: str) -> None:
    from unison.config.fields import add_options_command

    add_options_command(sub, "export", help_text,
                        __doc__.splitlines()[0], ExportOptions, cmd_export)
