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
* ``vit_micro|nano|tiny|small|base`` with 16 px patches, ``..._p8`` (8 px patches, 64 px images), ``..._p4``
  (4 px patches, 32 px images) and ``..._p2`` (2 px patches, 16 px images): Vision Transformers with
  token-level access for the masked-image methods (`unison.models.vit`); ``..._auto`` takes the patch
  size from the image size (at least 8 x 8 patches: 2 px at 16 px, 4 at 32, 8 at 64, 16 at 224), pinned
  by `resolve_backbone` as a ResNet's stem is.
* ``timm:<name>``: any timm model with ``num_classes=0`` (requires ``pip install timm``), with the
  run's ``--backbone-arg NAME=VALUE`` settings and ``img_size`` = the training crop size when the
  model takes one (`timm_backbone`); with crops of several sizes (multi-crop), ``dynamic_img_size=True``.

Example::

    net, dim = build_backbone("resnet50", image_size=224)   # torchvision's resnet50 without fc, dim 2048
    resolve_backbone("resnet18", 32)                         # "resnet18_cifar"
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn as nn

from unison.errors import ConfigError

from .vit import VIT_AUTO, VIT_BACKBONES, build_vit, pin_vit, vit_patch_size

CIFAR_STEM_MAX_SIZE = 64
RESNETS = ("resnet18", "resnet50")
PINNED_RESNETS = tuple(f"{r}_{stem}" for r in RESNETS for stem in ("cifar", "imagenet"))
BACKBONES = ("small_cnn", *RESNETS, *PINNED_RESNETS, *VIT_BACKBONES, *VIT_AUTO)


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
    """The pinned name of `name` at `image_size`: ``resnet18`` -> ``resnet18_cifar`` or ``resnet18_imagenet``,
    ``vit_tiny_auto`` -> ``vit_tiny_p4`` at 32 px or ``vit_tiny`` at 224 px (`unison.models.vit.pin_vit`)."""
    if name in RESNETS:
        stem = "imagenet" if image_size is not None and image_size > CIFAR_STEM_MAX_SIZE else "cifar"
        return f"{name}_{stem}"
    return pin_vit(name, image_size)


def patch_size_of(name: str, image_size: int | None, backbone_args: dict[str, Any] | None = None) -> int | None:
    """The patch size of backbone `name` at `image_size` (None: not patch-based, e.g. a CNN): a unison ViT's
    from its (pinned) name, a timm model's from a build on the meta device (no memory, no weights)."""
    name = resolve_backbone(name, image_size)
    if name in VIT_BACKBONES:
        return vit_patch_size(name)
    if name.startswith("timm:"):
        with torch.device("meta"):
            model, _ = timm_backbone(name[5:], image_size, backbone_args or {})
        return _timm_patch_and_fixed_size(model)[0]
    return None


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


def build_backbone(name: str, image_size: int | None = None, *, backbone_args: dict[str, Any] | None = None,
                   view_sizes: Sequence[int] = ()) -> tuple[nn.Module, int]:
    """`image_size` picks the ResNet stem and reaches timm models; `backbone_args` reach timm models only.
    `view_sizes`: the sizes of the views the backbone will see (multi-crop: global and local crops), checked
    against a ViT's patch size (`check_view_sizes`); a timm model then takes them all (``dynamic_img_size``)."""
    name = resolve_backbone(name, image_size)
    if name == "small_cnn":
        cnn = SmallCNN()
        return cnn, cnn.feature_dim
    if name in PINNED_RESNETS:
        return resnet(name)
    if name in VIT_BACKBONES:
        check_view_sizes(name, vit_patch_size(name), None, view_sizes)
        vit = build_vit(name)
        return vit, vit.feature_dim
    if name.startswith("timm:"):
        return timm_backbone(name[5:], image_size, backbone_args or {}, view_sizes)
    raise ValueError(f"unknown backbone {name!r}; use one of {', '.join(BACKBONES)} or timm:<model>")


def check_view_sizes(what: str, patch: int | None, fixed: int | None, view_sizes: Sequence[int]) -> None:
    """One-line `ConfigError` for a view a patch-based backbone cannot take: a crop other than the image size
    (``view_sizes[0]``, the global crops) that is smaller than one patch or not a multiple of the patch size,
    or any other size where the model takes only `fixed` px inputs. The pre-flight (`check_backbone`) and the
    workers' build call it, so both refuse with the same words."""
    if not view_sizes:
        return
    image = view_sizes[0]
    for size in sorted(set(view_sizes) - {image}):
        if patch and size % patch:
            raise ConfigError(f"the local crops of {size} px are not a multiple of the patch size {patch} of "
                              f"{what}; give --local-crop-size a multiple of {patch} (e.g. "
                              f"{max(patch, size // patch * patch)}) or --local-crops 0")
        if fixed and size != fixed:
            raise ConfigError(f"{what} takes only {fixed} px inputs and the local crops are {size} px; give "
                              f"--local-crop-size {fixed}, --local-crops 0, or a model that takes any size "
                              "(--backbone-arg dynamic_img_size=true)")


def _create_timm(timm: Any, model: str, image_size: int | None, kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model`` with ``img_size=image_size`` when the model takes one and `kwargs` sets none."""
    return _create_timm_with(timm, model, image_size, kwargs)[0]


def _create_timm_with(timm: Any, model: str, image_size: int | None,
                      kwargs: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """`_create_timm`'s model and the arguments it was created with."""
    if image_size is not None and "img_size" not in kwargs:
        try:
            return timm.create_model(model, img_size=image_size, **kwargs), {**kwargs, "img_size": image_size}
        except TypeError as exc:
            if not re.search(r"\bimg_size\b", str(exc)):   # the model takes no image size (CNNs): build it without
                raise
    return timm.create_model(model, **kwargs), dict(kwargs)


def timm_create_kwargs(model: str, image_size: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``timm.create_model(model, ...)`` that build `timm_backbone`'s model for `image_size` and
    `args` (``num_classes=0``, the ``--backbone-arg`` values, ``img_size`` when the model takes one): what loading
    its weights needs (a ViT's position embedding and patch projection follow ``img_size`` and ``patch_size``).
    Built on the meta device: no memory, no weights."""
    import timm

    with torch.device("meta"):
        return {k: v for k, v in _create_timm_with(timm, model, image_size, {"num_classes": 0, **args})[1].items()
                if k != "pretrained"}


def timm_backbone(model: str, image_size: int | None, args: dict[str, Any],
                  view_sizes: Sequence[int] = ()) -> tuple[nn.Module, int]:
    """``timm.create_model(model, num_classes=0, **args)``, with ``img_size=image_size`` when the model takes an
    image size and `args` does not set one (ViTs, Swin, ...: their patch grid and position embeddings follow it),
    and ``dynamic_img_size=True`` when `view_sizes` holds several sizes (multi-crop), the model takes it and
    `args` does not set it (timm ViTs then resample their position embeddings to each crop's grid).

    `args` are the run's ``--backbone-arg NAME=VALUE`` (``drop_path_rate``, ``patch_size``, ...). An unknown
    model, an argument the model does not take or a crop size it cannot take is a one-line `ConfigError`."""
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
        m = None
        if len(set(view_sizes)) > 1 and "dynamic_img_size" not in args:
            try:
                m = _create_timm(timm, model, image_size, {**kwargs, "dynamic_img_size": True})
            except TypeError as exc:
                if "dynamic_img_size" not in str(exc):   # the model takes no dynamic size: the check below says so
                    raise
        m = m if m is not None else _create_timm(timm, model, image_size, kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no --backbone-arg"
        raise ConfigError(f"timm model {model!r} cannot be built with {given}"
                          f"{f' and img_size={image_size}' if image_size else ''}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    patch, fixed = _timm_patch_and_fixed_size(m)
    check_view_sizes(f"timm:{model}", patch, fixed, view_sizes)
    return m, _num_features(m)


def _timm_patch_and_fixed_size(model: nn.Module) -> tuple[int | None, int | None]:
    """A timm model's patch size (None: no patch embedding) and the one input size it takes (None: any)."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    img = getattr(embed, "img_size", None)
    img = img[0] if isinstance(img, (tuple, list)) else img
    strict = getattr(embed, "strict_img_size", False) and not getattr(model, "dynamic_img_size", False)
    return (int(patch) if patch else None), (int(img) if strict and img else None)


def _num_features(model: nn.Module) -> int:
    """A timm model's embedding width: a plain int attribute that nn.Module's stubs type as Tensor | Module."""
    return int(cast(int, model.num_features))


def check_backbone(name: str, image_size: int | None = None, backbone_args: dict[str, Any] | None = None,
                   view_sizes: Sequence[int] = ()) -> None:
    """Build `name` on the meta device (no memory, no weights): a bad timm model name or argument, or a view size
    the backbone cannot take (`check_view_sizes`), is a one-line `ConfigError` before any worker starts."""
    name = resolve_backbone(name, image_size)
    if name.startswith("timm:"):
        with torch.device("meta"):
            timm_backbone(name[5:], image_size, backbone_args or {}, view_sizes)
    elif name in VIT_BACKBONES:
        check_view_sizes(name, vit_patch_size(name), None, view_sizes)
