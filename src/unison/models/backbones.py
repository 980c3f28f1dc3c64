"""Encoders: a small CNN for CPU runs, torchvision ResNets with the stem the image size needs, ViTs, timm models.

`build_backbone(name, image_size=None)` returns ``(module, feature_dim)``; the module maps
images [B, 3, H, W] to features [B, feature_dim] (no classifier).

* ``small_cnn``: 4 conv-BN-ReLU blocks and global average pooling; trains in seconds on CPU.
* ``resnet18`` / ``resnet50``: torchvision's ResNets, ``fc`` removed. The stem follows the image
  size, as in solo-learn (and what a user of either field expects of the plain name):

  - above `CIFAR_STEM_MAX_SIZE` (64 px): torchvision's standard ImageNet stem (7x7 conv stride 2,
    3x3 max-pool): the model is exactly ``torchvision.models.resnet18()``;
  - at 64 px and below, or when no size is known: the CIFAR stem (3x3 conv stride 1, no max-pool),
    as in Lightly's and solo-learn's CIFAR benchmarks (at 32 px the ImageNet stem leaves 1x1 maps
    after layer 4; at 224 px the CIFAR stem costs about 16x the FLOPs of the standard one).

  ``resnet18_cifar`` / ``resnet50_cifar`` and ``resnet18_imagenet`` / ``resnet50_imagenet`` pin the
  stem whatever the size. `resolve_backbone` gives the pinned name a run used (recorded in the
  checkpoint, so `unison export` / `unison eval` rebuild the same stem). The export loads into
  torchvision as is (ImageNet stem) or after the same stem surgery (CIFAR stem), ``fc.*`` missing.
* ``vit_nano|tiny|small|base`` with 16 px patches, ``..._p4`` (4 px patches, 32 px images) and
  ``..._p2`` (2 px patches, 16 px images): Vision Transformers with token-level access for
  the masked-image methods (`unison.models.vit`).
* ``timm:<name>``: any timm model with ``num_classes=0`` (requires ``pip install timm``), with the
  run's ``--backbone-arg NAME=VALUE`` settings and ``img_size`` = the training crop size when the
  model takes one (`timm_backbone`).

Example::

    net, dim = build_backbone("resnet50", image_size=224)   # torchvision's resnet50 without fc, dim 2048
    resolve_backbone("resnet18", 32)                         # "resnet18_cifar"
"""

from __future__ import annotations

import difflib
from typing import Any, cast

import torch
import torch.nn as nn

from .vit import VIT_BACKBONES, build_vit

CIFAR_STEM_MAX_SIZE = 64
RESNETS = ("resnet18", "resnet50")
PINNED_RESNETS = tuple(f"{r}_{stem}" for r in RESNETS for stem in ("cifar", "imagenet"))
BACKBONES = ("small_cnn", *RESNETS, *PINNED_RESNETS, *VIT_BACKBONES)


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, in_channels: int = 3):
        super().__init__()
        w = width

        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*block(in_channels, w, 1), *block(w, 2 * w, 2), *block(2 * w, 4 * w, 2),
                                      *block(4 * w, 4 * w, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.feature_dim = 4 * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def resolve_backbone(name: str, image_size: int | None) -> str:
    """The pinned name of `name` at `image_size`: ``resnet18`` -> ``resnet18_cifar`` or ``resnet18_imagenet``."""
    if name in RESNETS:
        stem = "imagenet" if image_size is not None and image_size > CIFAR_STEM_MAX_SIZE else "cifar"
        return f"{name}_{stem}"
    return name


def resnet(name: str) -> tuple[nn.Module, int]:
    """A pinned ResNet (``resnet18_cifar``, ``resnet50_imagenet``, ...) without ``fc``."""
    import torchvision

    arch, stem = name.rsplit("_", 1)
    model = getattr(torchvision.models, arch)(weights=None)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, dim


def build_backbone(name: str, image_size: int | None = None, *,
                   backbone_args: dict[str, Any] | None = None) -> tuple[nn.Module, int]:
    """`image_size` picks the ResNet stem and reaches timm models; `backbone_args` reach timm models only."""
    name = resolve_backbone(name, image_size)
    if name == "small_cnn":
        cnn = SmallCNN()
        return cnn, cnn.feature_dim
    if name in PINNED_RESNETS:
        return resnet(name)
    if name in VIT_BACKBONES:
        vit = build_vit(name)
        return vit, vit.feature_dim
    if name.startswith("timm:"):
        return timm_backbone(name[5:], image_size, backbone_args or {})
    raise ValueError(f"unknown backbone {name!r}; use one of {', '.join(BACKBONES)} or timm:<model>")


def timm_backbone(model: str, image_size: int | None, args: dict[str, Any]) -> tuple[nn.Module, int]:
    """``timm.create_model(model, num_classes=0, **args)``, with ``img_size=image_size`` when the model takes an
    image size and `args` does not set one (ViTs, Swin, ...: their patch grid and position embeddings follow it).

    `args` are the run's ``--backbone-arg NAME=VALUE`` (``drop_path_rate``, ``patch_size``, ...). An unknown
    model or an argument the model does not take is a one-line `ConfigError`."""
    from unison.errors import ConfigError

    try:
        import timm
    except ImportError:
        raise ConfigError(f"backbone 'timm:{model}' needs timm: pip install timm") from None
    if not timm.is_model(model):
        close = difflib.get_close_matches(model, timm.list_models(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"timm has no model {model!r}{hint}; see timm.list_models()")
    kwargs = {"pretrained": False, "num_classes": 0, **args}
    try:
        if image_size is not None and "img_size" not in args:
            try:
                m = timm.create_model(model, img_size=image_size, **kwargs)
                return m, _num_features(m)
            except TypeError as exc:
                if "img_size" not in str(exc):   # the model takes no image size (CNNs): build it without
                    raise
        m = timm.create_model(model, **kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no --backbone-arg"
        raise ConfigError(f"timm model {model!r} cannot be built with {given}"
                          f"{f' and img_size={image_size}' if image_size else ''}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    return m, _num_features(m)


def _num_features(model: nn.Module) -> int:
    """A timm model's embedding width: a plain int attribute that nn.Module's stubs type as Tensor | Module."""
    return int(cast(int, model.num_features))


def check_backbone(name: str, image_size: int | None = None, backbone_args: dict[str, Any] | None = None) -> None:
    """Build `name` on the meta device (no memory, no weights): a bad timm model name or argument is a one-line
    `ConfigError` before any worker starts."""
    if name.startswith("timm:"):
        with torch.device("meta"):
            timm_backbone(name[5:], image_size, backbone_args or {})
